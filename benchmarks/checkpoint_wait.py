"""How long the training loop waits on checkpoints, saved in the loop or in the background (--async-checkpoint):
summary.json's checkpoint_wait_s of the issue's run (a 12.7M-parameter MLP on digits, Adam, a checkpoint every 5
steps, 30 steps, 2 workers) under ddp and fsdp, interleaved, medians of `--repeats`; run it alone.

    python benchmarks/checkpoint_wait.py [--repeats 3] [--strategies ddp fsdp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from summaries import trained  # benchmarks/summaries.py, beside this script

FLAGS = ["--model", "mlp", "--width", "2048", "--depth", "4", "--dataset", "digits", "--optimizer", "adam",
         "--steps", "30", "--checkpoint-every", "5", "--devices", "2", "--quiet", "--no-tensorboard", "--overwrite"]


def run_once(strategy: str, background: bool, out: Path) -> dict:
    return trained([*FLAGS, "--strategy", strategy, *(["--async-checkpoint"] if background else [])], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args()
    cases = [(s, b) for s in args.strategies for b in (False, True)]
    waits: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    times: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on every case alike
            for case in cases:
                summary = run_once(*case, Path(tmp) / "run")
                waits[case].append(summary["checkpoint_wait_s"])
                times[case].append(summary["train_time_s"])
    print(f"| strategy | saves | checkpoint_wait_s (median of {args.repeats}) | against the loop's | "
          "train_time_s |")
    print("|---|---|---|---|---|")
    for strategy, background in cases:
        wait = statistics.median(waits[(strategy, background)])
        base = statistics.median(waits[(strategy, False)])
        print(f"| {strategy} | {'background' if background else 'in the loop'} | {wait:.2f} | {wait / base:.2f}x | "
              f"{statistics.median(times[(strategy, background)]):.1f} |")


if __name__ == "__main__":
    main()
