"""Datasets as in-memory uint8 tensors, and the pure functions that split a global batch over workers (batches)."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import UserError
from .splits import Splits

DATASETS = ("digits", "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "synthetic", "diabetes", "tokens",
            "imagefolder", "tensors", "csv", "text", "jsonl")
DEFAULT_DATA_DIR = "data"


def synthetic_side(channels: int) -> int:
    """Synthetic images look like CIFAR-10 (32x32) in colour and like MNIST (28x28) in grey."""
    return 32 if channels == 3 else 28


def load_dataset(name: str, data_dir: str | None = None, download: bool = True, val_size: int | None = None,
                 channels: int = 1, labels: str = "fine", test_size: int | None = None) -> Splits:
    """Load a dataset into memory; `channels` only shapes the synthetic one, `labels` CIFAR-100's classes."""
    folder = data_dir or str(Path(DEFAULT_DATA_DIR) / name)
    if name == "digits":
        from . import digits

        return digits.load(val_size)
    if name in ("mnist", "fashion-mnist", "kmnist"):
        from . import mnist

        return mnist.load(folder, download, val_size, name)
    if name == "cifar10":
        from . import cifar10

        return cifar10.load(folder, download, val_size)
    if name == "cifar100":
        from . import cifar100

        return cifar100.load(folder, download, val_size, labels)
    if name == "custom":
        raise UserError("dataset 'custom' is tensors of your own: pass them to paratrain.fit or "
                        "paratrain.evaluate(run, data); from the command line choose a dataset by name")
    if name == "imagefolder":
        from . import folder

        if not data_dir:
            raise UserError("dataset 'imagefolder' needs a folder: --data-dir DIR (data_dir=...)")
        return folder.load(data_dir, val_size=val_size)
    if name in ("diabetes", "tokens"):
        from . import bundled

        return bundled.diabetes(val_size, test_size) if name == "diabetes" else bundled.tokens(val_size, test_size)
    if name in ("tensors", "csv", "text"):  # the command line's: inputs.load_for reads them (a csv needs its --target)
        raise UserError(f"dataset '{name}' is read from --data-dir by paratrain train (paratrain.fit(model, path))")
    if name == "synthetic":
        from . import synthetic

        return synthetic.load(channels, synthetic_side(channels), val_size)
    raise UserError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "Splits", "load_dataset", "synthetic_side"]
