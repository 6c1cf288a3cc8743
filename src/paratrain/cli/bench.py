"""`paratrain bench`: the same training in every device configuration, with plots (paratrain/bench.py runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import config as C
from ..rundir import check_writable
from .parser import at_least_one


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the same training in every device configuration, with plots")
    p.add_argument("--model", default="lenet5", choices=C.MODELS[:-1])  # not custom (Python only)
    p.add_argument("--dataset", default="mnist", choices=C.DATASETS[:-1])
    p.add_argument("--data-dir")
    p.add_argument("--no-download", dest="download", action="store_false",
                   help="never download: a missing dataset is an error")
    p.add_argument("--configs", help="e.g. cpu:1t,cpu:2t,ddp-cpu:2,gpu:1,gpu:2,tower-gpu:2 (default: all here)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs per run (default: 2)")
    length.add_argument("--steps", type=int, help="steps per run instead")
    p.add_argument("--batch-size", type=int, help="global batch (default: the dataset's)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration (default: 2)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run configurations with more CPU workers than cores (marked in the report)")
    p.add_argument("--out", required=True, help="report directory")
    p.set_defaults(run=run)


def _train_flags(args: argparse.Namespace) -> list[str]:
    """The `paratrain train` flags every configuration shares."""
    flags = ["--model", args.model, "--dataset", args.dataset, "--log-every", "20"]
    flags += ["--data-dir", args.data_dir] if args.data_dir else []
    flags += [] if args.download else ["--no-download"]
    flags += ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs or 2)]
    flags += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    return flags + (["--oversubscribe"] if args.oversubscribe else [])


def run(args: argparse.Namespace) -> int:
    from .. import bench, devices, plot
    from ..inputs import load_for

    at_least_one(args, "repeats", "epochs", "steps", "batch_size")
    check_writable(args.out)
    import torch

    configs = (bench.parse_configs(args.configs) if args.configs
               else bench.default_configs(devices.usable_cores(), torch.cuda.device_count()))
    load_for(C.validate(C.TrainConfig(model=args.model, dataset=args.dataset, data_dir=args.data_dir,
                                        download=args.download)))  # a missing dataset fails here, once
    out = Path(args.out)
    report = bench.run_bench(configs, _train_flags(args), args.repeats, out)
    path = plot.write_report(report, out)
    failed = [r["name"] for r in report["results"] if r["status"] != "ok"]
    print(f"bench: {len(configs) - len(failed)} of {len(configs)} configurations measured"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''}; report: {path}")
    return 0
