"""paratrain's DDP against the usual torchrun + DistributedSampler + DataLoader script, same global batch.

    python benchmarks/ddp_vs_dataloader.py --data-dir ../shared/data/mnist [--workers 2] [--repeats 3]

Both train LeNet-5 on MNIST with 2 gloo workers x 1 thread (on 2 cores), Adam, global batch 512,
--steps updates after warm-up; each row runs alone, in turn. Prints examples/sec and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def torchrun_row(data_dir: str, workers: int, batch: int, steps: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
           str(HERE / "torchrun_dataloader.py"), "--data-dir", data_dir, "--batch-size", str(batch),
           "--steps", str(steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["examples_per_sec"]


def paratrain_row(data_dir: str, workers: int, batch: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "paratrain", "train", "--quiet", "--no-tensorboard", "--out", out,
               "--dataset", "mnist", "--data-dir", data_dir, "--no-download", "--devices", str(workers),
               "--batch-size", str(batch), "--steps", str(steps), "--log-every", "1000000"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(out) / "summary.json").read_text())["examples_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows: dict[str, list[float]] = {"torchrun + DistributedSampler + DataLoader": [], "paratrain train": []}
    for _ in range(args.repeats):
        rows["torchrun + DistributedSampler + DataLoader"].append(
            torchrun_row(args.data_dir, args.workers, args.batch_size, args.steps))
        rows["paratrain train"].append(paratrain_row(args.data_dir, args.workers, args.batch_size, args.steps))
    print(f"LeNet-5, MNIST, {args.workers} gloo workers, global batch {args.batch_size}, {args.steps} steps, "
          f"{args.repeats} repeats")
    print(f"{'':<46}{'examples/sec (median)':>22}{'min..max':>20}")
    for name, values in rows.items():
        print(f"{name:<46}{statistics.median(values):>22,.0f}{f'{min(values):,.0f}..{max(values):,.0f}':>20}")
    ratio = statistics.median(rows["paratrain train"]) / statistics.median(
        rows["torchrun + DistributedSampler + DataLoader"])
    print(f"paratrain / DataLoader script: {ratio:.2f}x")


if __name__ == "__main__":
    main()
