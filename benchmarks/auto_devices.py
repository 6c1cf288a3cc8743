"""--devices auto against 1 and 2 workers: does the default ever lose? (issue 35)

    python benchmarks/auto_devices.py --data ../shared/data [--repeats 3] [--only resnet18|lenet5]

Workloads, each `paratrain train` in a fresh process, interleaved (auto, auto again, 1, 2 workers per
repeat), never beside another heavy process:
  resnet18  torchvision's ResNet-18 (benchmarks/nets.py) on CIFAR-10, batch 64, 600 steps
  lenet5    LeNet-5 on MNIST, batch 512, 1500 steps
Both are long enough that --devices auto measures 2 workers as well as 1 (a shorter run only measures 1);
  lenet5-short  the same at 150 steps: auto trains on 1 worker at once, to be compared with --devices 1.
"auto" starts with an empty cache of measured rates, so it pays for its measurements; "auto, cached" runs
again with the rates it kept. Prints, per row, the median (and range) of the training rate (summary.json's
examples_per_sec) and of the command's wall time, what auto chose and what choosing cost, and the rate as a
fraction of the faster of 1 and 2 workers (the acceptance: at least 0.9) and of 1 worker (where auto chose 1:
at least 0.97).
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

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    "resnet18": (["--model", f"{HERE / 'nets.py'}:resnet18", "--dataset", "cifar10", "--batch-size", "64",
                  "--steps", "600"], "cifar-10-batches-bin"),
    "lenet5": (["--model", "lenet5", "--dataset", "mnist", "--batch-size", "512", "--steps", "1500"], "mnist"),
    # too short to measure 2 workers: auto trains on 1 at once, and must run as fast as --devices 1 (issue 47:
    # a forkserver started on a guess beside it cost it 0.79x)
    "lenet5-short": (["--model", "lenet5", "--dataset", "mnist", "--batch-size", "512", "--steps", "150"], "mnist"),
}
ROWS = ("auto", "auto, cached", "1", "2")


def run_once(flags: list[str], devices: str, cache: Path, scratch: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "PARATRAIN_DEVICES_CACHE": str(cache)}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *flags, "--devices", devices, "--quiet",
                           "--no-tensorboard", "--no-download", "--out", str(out / "run")],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{devices}: {proc.stderr.strip()[-2000:]}")
    summary = json.loads((out / "run" / "summary.json").read_text())
    auto = summary.get("devices_auto") or {}
    return {"rate": summary["examples_per_sec"], "wall": wall, "workers": auto.get("workers"),
            "cost": auto.get("cost_s"), "rates": auto.get("rates")}


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}..{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder with mnist/ and cifar-10-batches-bin/")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="auto-devices-"))
    for name, (flags, folder) in WORKLOADS.items():
        if args.only and name != args.only:
            continue
        flags = [*flags, "--data-dir", str(Path(args.data) / folder)]
        runs: dict[str, list[dict]] = {row: [] for row in ROWS}
        for repeat in range(args.repeats):
            cache = scratch / f"{name}-{repeat}.json"  # empty: this repeat's auto measures afresh
            for row in ROWS:
                devices = "auto" if row.startswith("auto") else row
                runs[row].append(run_once(flags, devices, cache, scratch))
                r = runs[row][-1]
                print(f"# {name} repeat {repeat + 1} {row}: {r['rate']:,.0f} ex/s, {r['wall']:.1f} s"
                      + (f", chose {r['workers']} ({r['rates']}, cost {r['cost']} s)" if r["workers"] else ""),
                      flush=True)
        faster = max(statistics.median(r["rate"] for r in runs[row]) for row in ("1", "2"))
        one = statistics.median(r["rate"] for r in runs["1"])
        print(f"\n{name}: {' '.join(flags)}\n")
        print("| devices | examples/s, median (range) | wall s, median (range) | chose | choosing cost (s) "
              "| of faster | of 1 worker |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in ROWS:
            rs = runs[row]
            chose = ", ".join(str(r["workers"]) for r in rs) if row.startswith("auto") else "-"
            cost = ", ".join(f"{r['cost']:.1f}" for r in rs) if row.startswith("auto") else "-"
            share, of_one = (statistics.median(r["rate"] for r in rs) / d for d in (faster, one))
            print(f"| {row} | {median_range([r['rate'] for r in rs])} | {median_range([r['wall'] for r in rs])} | "
                  f"{chose} | {cost} | {share:.2f}x | {of_one:.2f}x |")
        print(flush=True)


if __name__ == "__main__":
    main()
