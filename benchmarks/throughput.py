"""Training throughput of LeNet-5 on MNIST-shaped data: paratrain against plain PyTorch loops.

    python benchmarks/throughput.py [--data-dir ../shared/data/mnist] [--steps 300] [--repeats 3]

Rows (each measured in a fresh process, one after another, never side by side):
  plain-loop        one process, all cores as threads, the whole dataset as in-memory tensors
  dataloader-loop   the classic examples' way on a CPU (pytorch/examples mnist/main.py): torchvision
                    per-sample transforms in a DataLoader with its defaults (no loader processes),
                    all cores as threads
  paratrain N       `paratrain train` with its defaults except --devices N, --steps and --batch-size
  ... (baseline)    the same, run from another checkout's src/ (--baseline DIR): before against after a
                    change, measured in one run, interleaved
Prints examples/sec (median and spread over repeats) and each row's ratio to plain-loop.
Run it alone: any other heavy process on the machine ruins the figures.
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

WARMUP = 10


def _data(data_dir: str | None):  # noqa: ANN202
    from paratrain.data import load_dataset

    return load_dataset("mnist" if data_dir else "synthetic", data_dir, download=False)


def plain_loop(data_dir: str | None, steps: int, batch: int) -> float:
    """The reference: what one process does with PyTorch alone and tensors in memory."""
    import torch
    import torch.nn.functional as F

    from paratrain.models import build_model
    from paratrain.runtime.proc import tune_malloc

    tune_malloc()
    torch.set_num_threads(os.cpu_count() or 1)
    x_all, y_all = _data(data_dir).train

    def prepare(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x.float().div_(255).sub_(0.1307).div_(0.3081), (2, 2, 2, 2), value=-0.1307 / 0.3081)

    return timed_steps(build_model("lenet5", 1, 32, 10), x_all, y_all, batch, steps, prepare)


def timed_steps(model, x_all, y_all, batch: int, steps: int, prepare) -> float:  # noqa: ANN001
    """Examples/sec of `steps` Adam steps on random batches of in-memory tensors (`prepare` makes a batch of
    images the model's input), after WARMUP steps: the plain loop as users write it."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    t0 = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            t0 = time.perf_counter()
        idx = torch.randint(0, len(y_all), (batch,), generator=g)
        loss = F.cross_entropy(model(prepare(x_all[idx])), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * batch / (time.perf_counter() - t0)


def dataloader_loop(data_dir: str | None, steps: int, batch: int) -> float:
    import torch
    import torch.nn.functional as F
    from torchrun_dataloader import PilMnist  # the same per-sample dataset as the torchrun row
    from torchvision import transforms

    from paratrain.models import build_model
    from paratrain.runtime.proc import tune_malloc

    tune_malloc()
    torch.set_num_threads(os.cpu_count() or 1)
    x_all, y_all = _data(data_dir).train
    tf = transforms.Compose([transforms.Pad(2), transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    loader = torch.utils.data.DataLoader(PilMnist(x_all, y_all, tf), batch_size=batch, shuffle=True,
                                         drop_last=True)
    model = build_model("lenet5", 1, 32, 10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    done, t0 = 0, 0.0
    while done < WARMUP + steps:
        for x, y in loader:
            if done == WARMUP:
                t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == WARMUP + steps:
                break
    return steps * batch / (time.perf_counter() - t0)


def paratrain_run(data_dir: str | None, steps: int, batch: int, devices: int, src: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as out:
        dataset = ["--dataset", "mnist", "--data-dir", data_dir, "--no-download"] if data_dir else \
            ["--dataset", "synthetic"]
        cmd = [sys.executable, "-m", "paratrain", "train", "--quiet", "--out", out, *dataset, "--devices",
               str(devices), "--steps", str(steps), "--batch-size", str(batch), "--log-every", "1000000"]
        # another checkout's paratrain, found before the installed one
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))} \
            if src else None
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        return json.loads((Path(out) / "summary.json").read_text())["examples_per_sec"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="real MNIST files (default: synthetic MNIST-shaped data)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--devices", default="1,2", help="paratrain worker counts to measure")
    p.add_argument("--baseline", help="a checkout of paratrain (its src/ folder) to measure beside this one")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row in this process
    args = p.parse_args()
    if args.baseline and not (Path(args.baseline) / "paratrain" / "__init__.py").is_file():
        p.error(f"--baseline {args.baseline}: no paratrain package there; give a checkout's src/ folder")
    if args.row:
        fn = {"plain-loop": plain_loop, "dataloader-loop": dataloader_loop}[args.row]
        print(json.dumps(fn(args.data_dir, args.steps, args.batch_size)))
        return

    def isolated(row: str) -> float:
        cmd = [sys.executable, __file__, "--row", row, "--steps", str(args.steps), "--batch-size",
               str(args.batch_size)] + (["--data-dir", args.data_dir] if args.data_dir else [])
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for row in ("plain-loop", "dataloader-loop"):
            rows.setdefault(row, []).append(isolated(row))
        for n in map(int, args.devices.split(",")):
            rows.setdefault(f"paratrain --devices {n}", []).append(
                paratrain_run(args.data_dir, args.steps, args.batch_size, n))
            if args.baseline:
                rows.setdefault(f"  ... {n} (baseline)", []).append(
                    paratrain_run(args.data_dir, args.steps, args.batch_size, n, args.baseline))
    base = statistics.median(rows["plain-loop"])
    print(f"LeNet-5, {'MNIST' if args.data_dir else 'synthetic MNIST-shaped'} data, batch {args.batch_size}, "
          f"{args.steps} steps, {args.repeats} repeats, {os.cpu_count()} cores")
    print(f"{'configuration':<26}{'examples/sec (median)':>22}{'min..max':>20}{'vs plain-loop':>15}")
    for row, values in rows.items():
        med = statistics.median(values)
        print(f"{row:<26}{med:>22,.0f}{f'{min(values):,.0f}..{max(values):,.0f}':>20}{med / base:>14.2f}x")


if __name__ == "__main__":
    main()
