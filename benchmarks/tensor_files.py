"""Inputs in .npy files (--dataset tensors, a folder): read from the memory map a batch of rows at a time,
against the same arrays in memory (an .npz, handed to the workers in shared memory).

    python benchmarks/tensor_files.py [--steps 60] [--repeats 3] [--sizes-gb 0.5 2] [--keep DIR]

Two tables:
1. training examples/s on 2 CPU workers (1 thread each; the registry's mlp of width 256 over 1,024 float32
   features, batch 64) from the memory map and from memory, interleaved, median of --repeats. Goal: the
   memory map at 0.95x or better.
2. each worker's peak memory while training on inputs of --sizes-gb (random floats): its private memory
   (RssAnon) and its shared memory (RssShmem, where inputs in memory live), sampled every 0.1 s. The memory
   map's must not grow with the data (the file's pages are the page cache's, which the kernel reclaims).
Run it alone: any other heavy process on the machine ruins the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import paratrain

FEATURES = 1024


def write_folder(folder: Path, gigabytes: float) -> Path:
    """x_train.npy of random float32 features (written in pieces: never whole in memory), y_train.npy of
    float targets, and a small x_test / y_test."""
    folder.mkdir(parents=True, exist_ok=True)
    n = int(gigabytes * 2**30 / (4 * FEATURES))
    rng = np.random.default_rng(0)
    x = np.lib.format.open_memmap(folder / "x_train.npy", mode="w+", dtype=np.float32, shape=(n, FEATURES))
    for start in range(0, n, 16384):
        stop = min(start + 16384, n)
        x[start:stop] = rng.standard_normal((stop - start, FEATURES), dtype=np.float32)
    x.flush()
    del x
    np.save(folder / "y_train.npy", rng.standard_normal(n).astype(np.float32))
    np.save(folder / "x_test.npy", rng.standard_normal((512, FEATURES)).astype(np.float32))
    np.save(folder / "y_test.npy", rng.standard_normal(512).astype(np.float32))
    return folder


def as_npz(folder: Path, path: Path) -> Path:
    np.savez(path, **{f.stem: np.load(f) for f in folder.glob("*.npy")})
    return path


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        out += map(int, children)
        todo += map(int, children)
    return out


def train(data: Path, steps: int, out: Path) -> tuple[float, list[tuple[float, float]], tuple[float, float]]:
    """examples/s, each worker's peak (RssAnon, RssShmem) in MB, and this (the launching) process's."""
    peaks: dict[int, tuple[int, int]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in [os.getpid(), *descendants(os.getpid())]:
                try:
                    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                except (OSError, ValueError):
                    continue
                anon, shmem = (int(status.get(k, "0 kB").split()[0]) for k in ("RssAnon", "RssShmem"))
                old = peaks.get(pid, (0, 0))
                peaks[pid] = (max(old[0], anon), max(old[1], shmem))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        cfg = paratrain.TrainConfig(dataset="tensors", model="mlp", width=256, devices="2", threads_per_worker=1,
                                    steps=steps, batch_size=64, quiet=True, tensorboard=False, out=str(out),
                                    overwrite=True, checkpoint_every=0, val_size=0, log_every=10)
        rate = paratrain.fit(None, str(data), cfg)["examples_per_sec"]
    finally:
        done.set()
        sampler.join()
    me = peaks.pop(os.getpid(), (0, 0))
    workers = sorted(peaks.values(), key=lambda p: -p[0])[:2]  # the training workers: the two largest
    return rate, [(a / 1024, s / 1024) for a, s in workers], (me[0] / 1024, me[1] / 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes-gb", type=float, nargs="*", default=[0.5, 2.0])
    p.add_argument("--keep", type=Path, help="a folder for the generated files (default: a temporary one)")
    args = p.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="tensor-files-"))

    small = write_folder(work / "small", 0.25)
    npz = as_npz(small, work / "small.npz")
    rates: dict[str, list[float]] = {"memory map": [], "in memory": []}
    for _ in range(args.repeats):  # interleaved: drift on the machine hits both alike
        rates["memory map"].append(train(small, args.steps, work / "run-map")[0])
        rates["in memory"].append(train(npz, args.steps, work / "run-mem")[0])
    print(f"1. training on 2 CPU workers x 1 thread, mlp width 256 over {FEATURES} features, batch 64, "
          f"{args.steps} steps, median of {args.repeats} (0.25 GB of inputs)")
    print("| inputs from | examples/s (median) | runs |\n| --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    ratio = statistics.median(rates["memory map"]) / statistics.median(rates["in memory"])
    print(f"memory map / in memory: {ratio:.3f} (goal: at least 0.95)")

    print("\n2. peak memory while training (MB: private RssAnon / shared RssShmem), of each worker and of the "
          "process that loads the data and starts them")
    print("| inputs | from | worker peaks | launching process |\n| --- | --- | --- | --- |")
    for gb in args.sizes_gb:
        folder = write_folder(work / f"random-{gb:g}gb", gb)
        runs = [("memory map", folder)]
        if gb <= 1.0:  # in memory only where it fits comfortably
            runs.append(("in memory", as_npz(folder, work / f"random-{gb:g}gb.npz")))
        for name, data in runs:
            _, peaks, (a, s) = train(data, args.steps, work / "run-peak")
            print(f"| {gb:g} GB | {name} | {', '.join(f'{w:.0f} / {m:.0f}' for w, m in peaks)} | {a:.0f} / {s:.0f} |")


if __name__ == "__main__":
    main()
