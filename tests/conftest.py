"""Shared helpers: real-data folders (skipped where ../shared is absent) and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
MNIST_DIR = SHARED_DATA / "mnist"
CIFAR_DIR = SHARED_DATA / "cifar-10-batches-bin"


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST files not found in {MNIST_DIR} (they come with the project's shared/ folder)")
    return MNIST_DIR


@pytest.fixture
def cifar_dir() -> Path:
    if not (CIFAR_DIR / "data_batch_1.bin.gz").is_file():
        pytest.skip(f"real CIFAR-10 files not found in {CIFAR_DIR} (they come with the project's shared/ folder)")
    return CIFAR_DIR


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m paratrain ARGS` in a fresh process, as a user would run it."""
    return subprocess.run([sys.executable, "-m", "paratrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def train(run_dir: Path, *args: str, timeout: float = 300) -> dict:
    """Run `paratrain train --quiet --out run_dir ARGS`, insist it succeeded, return its summary."""
    proc = run_cli("train", "--quiet", "--out", str(run_dir), *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent may not have reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
