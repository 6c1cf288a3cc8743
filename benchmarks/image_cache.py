"""Image folders and the memory-mapped cache: how fast a folder decodes, whether training from the memory map
keeps up with the same images in memory, and whether a worker's private memory grows with the dataset.

    python benchmarks/image_cache.py [--images 3000] [--steps 60] [--repeats 3] [--sizes-gb 1 4] [--keep DIR]

Three tables:
1. the cache build: PNGs written in a temporary folder (64 x 64, colour), decoded with 1 process and with
   every core; images/s.
2. training examples/s on 2 CPU workers (1 thread each; the residual CNN of examples/, batch 64) from the
   memory map against the same images as a tensor in memory (shared with the workers), interleaved, median
   of --repeats. Goal: the memory map at 0.95x or better.
3. each worker's peak private memory (its anonymous resident memory, sampled every 0.1 s; not the shared
   page cache that the memory map reads through) while training from caches of --sizes-gb of random
   images (written directly as a cache file, 3 x 64 x 64 each). It must not grow with the dataset.
Run it alone: any other heavy process on the machine ruins the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import paratrain
from paratrain.data import folder
from paratrain.data.source import MappedImages
from paratrain.data.splits import Splits

ROOT = Path(__file__).resolve().parents[1]
MODEL = f"{ROOT / 'examples' / 'residual_cnn.py'}:build"


def write_pngs(root: Path, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        label = i % 3
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        pixels[16:48, 16:48, label] = 255  # a class you can see
        folder_ = root / f"c{label}"
        folder_.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder_ / f"{i:06d}.png")


def build_rates(root: Path, n: int) -> list[tuple[str, float]]:
    rows = []
    for workers in (1, len(os.sched_getaffinity(0))):
        cache = Path(tempfile.mkdtemp(prefix="cache-"))
        t0 = time.perf_counter()
        folder.load(str(root), cache_dir=str(cache), workers=workers, quiet=True)
        rows.append((f"{workers} process(es)", n / (time.perf_counter() - t0)))
    return rows


def in_memory(splits: Splits) -> Splits:
    return Splits(splits.name, *((p[0][:], p[1]) for p in (splits.train, splits.val, splits.test)), splits.mean,
                  splits.std, splits.num_classes, splits.classes)


def train_rate(splits: Splits, steps: int, out: Path) -> float:
    cfg = paratrain.TrainConfig(model=MODEL, devices="2", threads_per_worker=1, steps=steps, batch_size=64,
                                optimizer="sgd", lr=0.01, quiet=True, tensorboard=False, out=str(out),
                                overwrite=True, checkpoint_every=0, val_size=0)
    return paratrain.fit(None, splits, cfg)["examples_per_sec"]


def peak_private_mb(splits: Splits, steps: int, out: Path) -> list[float]:
    """Train on 2 workers while sampling each worker's RssAnon; the peaks in MB."""
    peaks: dict[int, int] = {}
    done = threading.Event()
    me = os.getpid()

    def sample() -> None:
        while not done.is_set():
            pids = subprocess.run(["pgrep", "-P", str(me)], capture_output=True, text=True).stdout.split()
            for pid in map(int, pids):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"spawn_main" not in cmd:
                    continue
                kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon")))
                peaks[pid] = max(peaks.get(pid, 0), kb)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        train_rate(splits, steps, out)
    finally:
        done.set()
        sampler.join()
    return sorted(kb / 1024 for kb in peaks.values())


def random_cache(path: Path, gigabytes: float) -> Splits:
    n = int(gigabytes * 2**30 / (3 * 64 * 64))
    images = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, 3, 64, 64))
    rng = np.random.default_rng(0)
    for start in range(0, n, 8192):
        stop = min(start + 8192, n)
        images[start:stop] = rng.integers(0, 256, (stop - start, 3, 64, 64), dtype=np.uint8)
    images.flush()
    del images
    source = MappedImages(str(path))
    labels = torch.from_numpy(rng.integers(0, 3, n)).long()
    test = (source.subset(np.arange(1000)), labels[:1000])
    return Splits("imagefolder", (source, labels), (source.subset(np.arange(0)), labels[:0]), test,
                  (0.5,) * 3, (0.29,) * 3, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes-gb", type=float, nargs="*", default=[1.0, 4.0])
    p.add_argument("--keep", type=Path, help="a folder for the generated files (default: a temporary one)")
    args = p.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="image-cache-"))
    pngs = work / "pngs"
    if not pngs.exists():
        write_pngs(pngs, args.images)

    print(f"1. cache build of {args.images} PNGs (64 x 64 colour), {len(os.sched_getaffinity(0))} cores")
    print("| decoding with | images/s |\n| --- | --- |")
    for name, rate in build_rates(pngs, args.images):
        print(f"| {name} | {rate:.0f} |")

    mapped = folder.load(str(pngs), quiet=True)
    memory = in_memory(mapped)
    rates: dict[str, list[float]] = {"memory map": [], "in memory": []}
    for _ in range(args.repeats):  # interleaved: drift on the machine hits both alike
        rates["memory map"].append(train_rate(mapped, args.steps, work / "run-map"))
        rates["in memory"].append(train_rate(memory, args.steps, work / "run-mem"))
    print(f"\n2. training on 2 CPU workers x 1 thread, residual CNN, batch 64, {args.steps} steps, median of "
          f"{args.repeats}")
    print("| images from | examples/s (median) | runs |\n| --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")
    ratio = statistics.median(rates["memory map"]) / statistics.median(rates["in memory"])
    print(f"memory map / in memory: {ratio:.3f} (goal: at least 0.95)")

    print("\n3. each worker's peak private memory (RssAnon) while training from a cache of random images")
    print("| cache | images | worker peaks (MB) |\n| --- | --- | --- |")
    for gb in args.sizes_gb:
        path = work / f"random-{gb:g}gb.npy"
        splits = random_cache(path, gb)
        peaks = peak_private_mb(splits, args.steps, work / "run-big")
        print(f"| {gb:g} GB | {len(splits.train[1]):,} | {', '.join(f'{m:.0f}' for m in peaks)} |")
        path.unlink()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
