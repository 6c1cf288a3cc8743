"""`paratrain report`: the bench plots and table for finished training runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.outputs import check_writable


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="the bench plots and table for finished training runs")
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", required=True, help="report directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..measure import bench, plot

    out = check_writable(args.out)
    results = [bench.result_from_run(Path(run)) for run in args.runs]
    bench.add_run_speedups(results)
    out.mkdir(parents=True, exist_ok=True)
    path = plot.write_report({"context": bench.context(), "results": results}, out, title="paratrain runs",
                             rates="summary")
    print(f"report: {path}")
    return 0
