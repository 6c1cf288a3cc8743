"""What "1 and N workers end with the same weights" means in numbers: how far runs that differ only in
their layout (workers, threads) end apart, for a network without BatchNorm and for one with it.

    python benchmarks/equal.py --data ../shared/data [--only lenet5|resnet18]

Each run is `paratrain train` in a fresh process, the same seed, data, global batch and steps:
  lenet5    LeNet-5 on MNIST, batch 512, 20 steps of SGD with momentum and 20 of Adam
  resnet18  torchvision's ResNet-18 (benchmarks/nets.py; 20 BatchNorm layers) on CIFAR-10, batch 64,
            100 Adam steps (BatchNorm synchronised across workers, the default)
in the layouts 1 worker x 1 thread, the same again, 1 worker x 2 threads, 2 workers x 1 thread. Prints,
against the first run, the largest difference over the weights and the norm of the difference over the
norm of the weights (the same for BatchNorm's running statistics), and each run's validation accuracy and
loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from paratrain.checkpoint import files as checkpoint

HERE = Path(__file__).resolve().parent
LAYOUTS = {"1 worker x 1 thread": ["--devices", "1", "--threads-per-worker", "1"],
           "the same again": ["--devices", "1", "--threads-per-worker", "1"],
           "1 worker x 2 threads": ["--devices", "1", "--threads-per-worker", "2"],
           "2 workers x 1 thread": ["--devices", "2", "--threads-per-worker", "1"]}
CASES = {
    "lenet5, SGD momentum": (["--model", "lenet5", "--dataset", "mnist", "--batch-size", "512", "--steps", "20",
                              "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05"], "mnist"),
    "lenet5, Adam": (["--model", "lenet5", "--dataset", "mnist", "--batch-size", "512", "--steps", "20",
                      "--optimizer", "adam", "--lr", "0.001"], "mnist"),
    "resnet18, Adam": (["--model", f"{HERE / 'nets.py'}:resnet18", "--dataset", "cifar10", "--batch-size", "64",
                        "--steps", "100", "--optimizer", "adam", "--lr", "0.001"], "cifar-10-batches-bin"),
}


def train(flags: list[str], out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A run's final weights (its state dict) and summary."""
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *flags, "--quiet", "--no-tensorboard",
                           "--no-download", "--seed", "0", "--out", str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr.strip()[-2000:])
    state = checkpoint.load(out)  # the newest step folder, read whole
    return state["model"], json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder with mnist/ and cifar-10-batches-bin/")
    parser.add_argument("--only", choices=["lenet5", "resnet18"])
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="equal-"))
    print("| network | layout | weights: largest difference | weights: relative (L2) | BatchNorm statistics: "
          "relative (L2) | val accuracy | val loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, (flags, folder) in CASES.items():
        if args.only and not case.startswith(args.only):
            continue
        flags = [*flags, "--data-dir", str(Path(args.data) / folder)]
        first = None
        for i, (layout, more) in enumerate(LAYOUTS.items()):
            state, summary = train([*flags, *more], scratch / f"{case.split(',')[0]}-{i}-{len(case)}")
            first = first or state
            weights, stats = (apart(state, first, lambda k, is_stat=is_stat: _is_stat(k) == is_stat)
                              for is_stat in (False, True))
            print(f"| {case} | {layout} | {weights[0]:.1e} | {weights[1]:.1e} | "
                  f"{'-' if stats is None else f'{stats[1]:.1e}'} | {summary['val_accuracy']:.4f} | "
                  f"{summary['val_loss']:.4f} |", flush=True)


def _is_stat(key: str) -> bool:
    return key.endswith(("running_mean", "running_var"))


def apart(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], which) -> tuple[float, float] | None:  # noqa: ANN001
    """The largest difference of the tensors `which` picks, and the L2 norm of their difference over theirs."""
    keys = [k for k in a if which(k) and a[k].is_floating_point()]  # not BatchNorm's batch counts
    if not keys:
        return None
    diff = torch.cat([(a[k] - b[k]).flatten().double() for k in keys])
    ref = torch.cat([b[k].flatten().double() for k in keys])
    return float(diff.abs().max()), float(diff.norm() / ref.norm())

if __name__ == "__main__":
    main()
