"""A device's peak FLOP/s, for the model FLOPs utilisation (MFU): the makers' dense figures for the GPUs of this
table, by the precision a run computes in; a CPU's is the matrix-multiply rate `paratrain doctor` measured on
this machine (kept in the user's cache), since no table knows a CPU's cores, clocks and vector units."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

# (name fragment as torch.cuda.get_device_name shows it, dense bf16/fp16 FLOP/s, dense TF32 FLOP/s (None: no TF32
# tensor cores, before Ampere), dense fp32 FLOP/s (tf32 off))
GPUS = (
    ("H200", 989e12, 494e12, 67e12), ("H100 PCIe", 756e12, 378e12, 51e12), ("H100", 989e12, 494e12, 67e12),
    ("GH200", 989e12, 494e12, 67e12), ("B200", 2250e12, 1100e12, 80e12), ("A100", 312e12, 156e12, 19.5e12),
    ("A10G", 70e12, 35e12, 31.2e12), ("A10", 125e12, 62.5e12, 31.2e12), ("L40S", 362e12, 183e12, 91.6e12),
    ("L4", 121e12, 60e12, 30.3e12), ("RTX 4090", 165e12, 82.6e12, 82.6e12), ("V100", 125e12, None, 15.7e12),
    ("T4", 65e12, None, 8.1e12),
)


def gpu_peak(name: str, precision: str) -> float | None:
    """The table's peak for the GPU named `name` at `precision` (a --precision); None: not in it."""
    for fragment, half, tf32, single in GPUS:
        if fragment in name:
            if precision == "tf32":
                return tf32 or single
            return single if precision == "32" else half
    return None


def _store() -> Path:
    from .env import user_cache

    return user_cache() / "peaks.json"


def _cpu_key(threads: int) -> str:
    return f"{platform.processor() or platform.machine()}|{os.cpu_count()} cpus|{threads} threads"


def cpu_peak(threads: int) -> float | None:
    """This machine's float32 matrix-multiply rate on `threads` threads, as doctor measured it (None: never)."""
    try:
        return float(json.loads(_store().read_text())[_cpu_key(threads)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_cpu(threads: int, size: int = 1024, repeats: int = 5) -> float:
    """The best of `repeats` float32 matrix multiplies of `size` on `threads` threads, in FLOP/s; kept for
    cpu_peak (a failed write keeps nothing: the figure is a convenience)."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        best = min(_timed(lambda: a @ b, time.perf_counter) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    rate = 2 * size**3 / best
    try:
        path = _store()
        known = json.loads(path.read_text()) if path.is_file() else {}
        known[_cpu_key(threads)] = rate
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known))
    except (OSError, ValueError):
        pass
    return rate


def _timed(fn, clock) -> float:  # noqa: ANN001
    start = clock()
    fn()
    return clock() - start
