"""What drawing dropout masks as one device does costs (features/dropout.py): the gpt on text, tokens/s with
dropout 0, with dropout 0.1 drawn for the global batch (paratrain's), and, on one worker, with dropout 0.1 as
torch draws it (the masks' interception switched off: what the runs did before). Runs interleaved, medians of
`--repeats`; run it alone.

    python benchmarks/dropout_masks.py --text FILE [--repeats 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# one run in a fresh process; NATIVE switches the interception off (one worker trains in that process)
RUN = """
import sys
if {native}:
    import paratrain.training.trainer as trainer
    trainer.has_dropout = lambda model: False  # torch's own dropout, from the global generator
from paratrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_once(text: str, devices: int, drop: float, native: bool, steps: int, out: Path) -> float:
    flags = ["train", "--dataset", "text", "--data-dir", text, "--optimizer", "adamw", "--width", "128", "--depth",
             "4", "--context", "128", "--batch-size", "16", "--steps", str(steps), "--log-every", "20",
             "--devices", str(devices), "--dropout", str(drop), "--quiet", "--no-tensorboard", "--overwrite",
             "--out", str(out)]
    code = RUN.format(native=native)
    proc = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]  # the first window: warm-up
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    cases = [("1 worker x 2 threads", 1, 0.0, False), ("1 worker x 2 threads", 1, 0.1, True),
             ("1 worker x 2 threads", 1, 0.1, False), ("2 workers x 1 thread", 2, 0.0, False),
             ("2 workers x 1 thread", 2, 0.1, False)]
    found: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved: the machine's drift falls on every case alike
            for i, (_, devices, drop, native) in enumerate(cases):
                found[i].append(run_once(args.text, devices, drop, native, args.steps, Path(tmp) / f"r{i}"))
    print(f"| layout | dropout | masks | tokens/s (median of {args.repeats}) | against dropout 0 |")
    print("|---|---|---|---|---|")
    for i, (layout, devices, drop, native) in enumerate(cases):
        base = statistics.median(found[next(j for j, c in enumerate(cases) if c[1] == devices and c[2] == 0)])
        rate = statistics.median(found[i])
        masks = "-" if drop == 0 else "torch's own (per worker)" if native else "the global batch's (paratrain)"
        print(f"| {layout} | {drop} | {masks} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
