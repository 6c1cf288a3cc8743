"""What --batchnorm sync costs: a conv-bn-relu CNN on 2 data-parallel workers, sync against local.

    python benchmarks/batchnorm.py [--data-dir ../shared/data/mnist] [--steps 200] [--repeats 3]

Rows: 1 worker (no BatchNorm synchronisation needed), 2 workers with --batchnorm local (each worker
normalises its own share), 2 workers with --batchnorm sync (two small all-reduces per BatchNorm layer and
step). Each run is its own `paratrain.fit` with workers x threads = cores, one after another in
interleaved order, never side by side; examples/sec is the summary's (training time only). Prints the
median and spread over repeats. Without --data-dir it trains on synthetic MNIST-shaped data.
Run it alone: any other heavy process on the machine ruins the figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from torch import nn

import paratrain


class ConvBN(nn.Sequential):
    """Three conv-bn-relu blocks (32, 64, 128 channels) and a linear head: a small modern CIFAR-style net."""

    def __init__(self) -> None:
        layers: list[nn.Module] = []
        channels = 1
        for width in (32, 64, 128):
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.MaxPool2d(2)]
            channels = width
        super().__init__(*layers, nn.Flatten(), nn.Linear(128 * 3 * 3, 10))


def one_run(devices: str, batchnorm: str, args: argparse.Namespace, out: Path) -> float:
    cores = torch.get_num_threads()
    cfg = paratrain.TrainConfig(devices=devices, batchnorm=batchnorm, steps=args.steps, batch_size=args.batch_size,
                                threads_per_worker=max(1, cores // int(devices)), out=str(out), quiet=True,
                                tensorboard=False, data_dir=args.data_dir, download=False, log_every=10**6)
    summary = paratrain.fit(ConvBN, "mnist" if args.data_dir else "synthetic", cfg,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    return summary["examples_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="the MNIST files (default: synthetic data)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {"1 worker": ("1", "sync"), "2 workers, local": ("2", "local"), "2 workers, sync": ("2", "sync")}
    figures: dict[str, list[float]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, (devices, mode) in rows.items():  # interleaved, so a slow spell hits every row
                figures[name].append(one_run(devices, mode, args, Path(tmp) / f"{repeat}-{devices}-{mode}"))
    print(f"ConvBN on {'MNIST' if args.data_dir else 'synthetic data'}, global batch {args.batch_size}, "
          f"{args.steps} steps, torch {torch.__version__}, {args.repeats} repeats")
    print(f"{'configuration':<20}{'ex/s median':>13}{'min':>9}{'max':>9}{'vs local':>10}")
    local = statistics.median(figures["2 workers, local"])
    for name, values in figures.items():
        med = statistics.median(values)
        print(f"{name:<20}{med:>13,.0f}{min(values):>9,.0f}{max(values):>9,.0f}{med / local:>10.2f}")


if __name__ == "__main__":  # the spawned workers import this file again
    main()
