"""Time from Enter to a trained model: where a run's time goes before its first step and after its last.

    python benchmarks/startup.py [--repeats 3] [--baseline OTHER_CHECKOUT/src] [-- TRAIN FLAGS]

Rows, each a fresh `paratrain train` (default: the README's main job, the digits on the default workers),
one after another, interleaved over --repeats (medians):
  import torch      `python -c "import torch"`: the reference the goal is stated against
  forkserver        this checkout as it runs by default (workers forked from a forkserver, prefork.py)
  spawn             this checkout with PARATRAIN_START_METHOD=spawn (every worker imports torch itself)
  baseline          another checkout's src/ (--baseline): wall time only, where it records no phases
For each: wall time, the start-up phases from summary.json (startup_s, finish_s), the first step's start
and the training time. Run it alone: any other heavy process on the machine ruins the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("imports", "data", "plan", "spawn", "join", "build", "first_step")
FINISH = ("evaluation", "checkpoint", "logs", "shutdown")


def timed_run(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def train_row(flags: list[str], env_extra: dict[str, str], src: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "run")
        env = {**os.environ, **env_extra}
        if src:  # another checkout's paratrain, found before the installed one
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
        wall = timed_run([sys.executable, "-m", "paratrain", "train", "--out", out, *flags], env)
        summary = json.loads((Path(out) / "summary.json").read_text())
    row = {"wall": wall, "train": summary["train_time_s"], "first_step_at": summary.get("first_step_at_s")}
    row.update({k: v for k, v in (summary.get("startup_s") or {}).items()})
    row.update({k: v for k, v in (summary.get("finish_s") or {}).items()})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", help="another checkout's src/ folder, measured beside this one")
    p.add_argument("flags", nargs="*", help="paratrain train flags (after --); default: the README's main job")
    args = p.parse_args()
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        rows.setdefault("import torch", []).append(
            {"wall": timed_run([sys.executable, "-c", "import torch"], dict(os.environ))})
        rows.setdefault("forkserver", []).append(train_row(args.flags, {}))
        rows.setdefault("spawn", []).append(train_row(args.flags, {"PARATRAIN_START_METHOD": "spawn"}))
        if args.baseline:
            rows.setdefault("baseline", []).append(train_row(args.flags, {}, args.baseline))
    keys = ("wall", "first_step_at", *PHASES, "train", *FINISH)
    print(f"paratrain train {' '.join(args.flags) or '(the README main job)'}; medians of {args.repeats}, seconds")
    print(f"{'':<13}" + "".join(f"{k:>14}" for k in keys))
    for name, runs in rows.items():
        cells = []
        for k in keys:
            values = [r[k] for r in runs if r.get(k) is not None]
            cells.append(f"{statistics.median(values):>14.2f}" if values else f"{'-':>14}")
        print(f"{name:<13}" + "".join(cells))


if __name__ == "__main__":
    main()
