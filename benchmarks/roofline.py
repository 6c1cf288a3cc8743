"""The training step against the machine's limit: matrix-multiply peak, FLOPs per example, the fraction reached.

    python benchmarks/roofline.py [--steps 200] [--repeats 3] [--models lenet5,cifar10-net] [--no-profile]

1. The peak: fp32 matrix multiplies (2048 x 2048) on all cores and on one, the best of several.
2. Each model's FLOPs per training example (forward + backward), counted by torch.utils.flop_counter.
3. Examples/sec of each configuration on synthetic data shaped like the model's dataset, each measured in a
   fresh process, one after another, interleaved over --repeats (medians):
     plain-loop      one process, all cores as threads, the data as in-memory tensors (benchmarks/throughput.py):
                     the loop as users write it (the reference), and with channels-last weights and batches
     paratrain N     `paratrain train --devices N` (its default path, --compile where asked): the rate of the
                     run's second half, from its log
   and the fraction of the peak that each reaches (examples/sec x FLOPs per example / peak).
4. A per-operator profile of one training step of each model (torch.profiler, self CPU time, forward and
   backward operators apart): where a step's time goes.
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

# model -> (channels, input side, batch, the dataset paratrain trains it on here)
MODELS = {"lenet5": (1, 32, 512, "synthetic"), "mnist-fast-net": (1, 28, 512, "synthetic"),
          "cifar10-net": (3, 24, 128, "synthetic"), "cifar10-fast-net": (3, 32, 512, "synthetic")}

def peak_gflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # the first call allocates and warms the threads
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _model(name: str):  # noqa: ANN202
    from paratrain.models import build_model

    channels, side, _, _ = MODELS[name]
    return build_model(name, channels, side, 10, width=512, depth=2, activation="relu", dropout=None, filters=64,
                       kernel=5)


def flops_per_example(name: str, batch: int = 64) -> float:
    """Forward and backward FLOPs of one training example (the optimizer's are negligible beside them)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    channels, side, _, _ = MODELS[name]
    model = _model(name)
    x, y = torch.randn(batch, channels, side, side), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


def plain_loop(name: str, steps: int, channels_last: bool = False) -> float:
    """What one process does with PyTorch alone: random batches of in-memory tensors, Adam, all cores
    (`channels_last`: weights and batches in that layout, as paratrain's default path has them)."""
    import torch
    from throughput import timed_steps  # the plain loop of benchmarks/throughput.py

    from paratrain.runtime.proc import tune_malloc

    tune_malloc()
    torch.set_num_threads(os.cpu_count() or 1)
    channels, side, batch, _ = MODELS[name]
    x_all, y_all = torch.randn(8192, channels, side, side), torch.randint(0, 10, (8192,))
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = _model(name).to(memory_format=layout)
    return timed_steps(model, x_all, y_all, batch, steps, lambda x: x.contiguous(memory_format=layout))


def paratrain_run(name: str, steps: int, devices: int, compiled: bool) -> float:
    _, _, batch, dataset = MODELS[name]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "paratrain", "train", "--quiet", "--out", out, "--model", name, "--dataset",
               dataset, "--devices", str(devices), "--steps", str(steps), "--batch-size", str(batch),
               "--log-every", str(steps // 2), "--no-tensorboard", *(["--compile"] if compiled else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        # the second half's rate, from the log: a compiled run compiles in its first steps (and every run
        # allocates its buffers there), which the summary's examples_per_sec would count
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "examples_per_sec" in r][-1]["examples_per_sec"]


def profile(name: str, channels_last: bool, top: int = 8) -> str:
    """Self CPU time per operator over a few training steps, the forward's and the backward's apart."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    torch.set_num_threads(os.cpu_count() or 1)
    channels, side, batch, _ = MODELS[name]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = _model(name).to(memory_format=layout)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, channels, side, side).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::") or "Backward" in e.key]
    # aten:: operators called inside an autograd node would count twice: keep the aten level only, and name
    # a backward operator by its aten kernel (convolution_backward, max_pool2d_with_indices_backward, ...)
    events = [e for e in events if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = [f"{name}, batch {batch}, {'channels-last' if channels_last else 'default layout'}: self CPU time per "
             f"step {total / 5 / 1000:.1f} ms",
             f"  {'operator':<44}{'phase':>10}{'ms/step':>10}{'share':>8}"]
    for e in events[:top]:
        phase = "backward" if "backward" in e.key else "optimizer" if "_foreach" in e.key else "forward"
        lines.append(f"  {e.key:<44}{phase:>10}{e.self_cpu_time_total / 5 / 1000:>10.2f}"
                     f"{e.self_cpu_time_total / total:>8.0%}")
    return "\n".join(lines)


def _isolated(*args: str) -> object:
    out = subprocess.run([sys.executable, __file__, "--row", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="lenet5,cifar10-net")
    p.add_argument("--devices", default="1,2", help="paratrain worker counts to measure")
    p.add_argument("--compile", action="store_true", help="also measure paratrain --compile rows")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--row", nargs="+", help=argparse.SUPPRESS)  # internal: one measurement in this process
    args = p.parse_args()
    if args.row:
        kind, *rest = args.row
        value = {"peak": lambda: peak_gflops(int(rest[0])), "flops": lambda: flops_per_example(rest[0]),
                 "plain": lambda: plain_loop(rest[0], args.steps),
                 "plain-cl": lambda: plain_loop(rest[0], args.steps, channels_last=True),
                 "profile": lambda: profile(rest[0], rest[1] == "cl")}[kind]()
        print(json.dumps(value))
        return
    models = args.models.split(",")
    cores = os.cpu_count() or 1
    peak = statistics.median(_isolated("peak", str(cores)) for _ in range(3))
    one = statistics.median(_isolated("peak", "1") for _ in range(3))
    print(f"fp32 matrix-multiply peak (2048^2, best of 5, median of 3 processes): {peak:.1f} GFLOP/s on {cores} "
          f"threads, {one:.1f} GFLOP/s on 1")
    rows: dict[tuple[str, str], list[float]] = {}
    flops = {m: _isolated("flops", m) for m in models}
    for _ in range(args.repeats):
        for m in models:
            rows.setdefault((m, "plain-loop"), []).append(_isolated("plain", m))
            rows.setdefault((m, "plain-loop channels-last"), []).append(_isolated("plain-cl", m))
            for n in map(int, args.devices.split(",")):
                for compiled in (False, True) if args.compile else (False,):
                    label = f"paratrain {n}" + (" --compile" if compiled else "")
                    rows.setdefault((m, label), []).append(paratrain_run(m, args.steps, n, compiled))
    print(f"{'model':<18}{'MFLOP/ex':>9}  {'configuration':<24}{'examples/s':>11}{'GFLOP/s':>9}{'of peak':>9}"
          f"{'vs plain':>9}")
    for (m, label), values in rows.items():
        rate = statistics.median(values)
        base = statistics.median(rows[(m, "plain-loop")])
        gflops = rate * flops[m] / 1e9
        print(f"{m:<18}{flops[m] / 1e6:>9.2f}  {label:<24}{rate:>11,.0f}{gflops:>9.1f}{gflops / peak:>9.1%}"
              f"{rate / base:>8.2f}x")
    if not args.no_profile:
        for m in models:
            for layout in ("default", "cl"):
                print(_isolated("profile", m, layout))


if __name__ == "__main__":
    main()
