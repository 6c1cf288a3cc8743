"""CIFAR-100 from the binary version (train.bin, test.bin: per image a coarse and a fine label byte, then
3,072 pixel bytes) or the python version (the pickles `train` and `test` that torchvision downloads), with
the 100 fine classes or the 20 coarse ones (--labels). The python pickles are read with CIFAR-10's
unpickler that only builds arrays."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ..core.errors import UserError
from .cifar10 import _ArraysOnly, locate
from .fetch import refuse_image_folder
from .mnist import read_bytes
from .splits import Splits, hold_out

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
RECORD = 2 + 3 * 32 * 32  # coarse label, fine label, then 1,024 red, 1,024 green, 1,024 blue
CLASSES = {"fine": 100, "coarse": 20}
VAL_SIZE = 5_000
MAX_RECORDS = 50_000
MAX_PICKLE_BYTES = 200 * 2**20  # the training pickle is 155 MB
ARCHIVES = ("cifar-100-binary.tar.gz", "cifar-100-python.tar.gz")
URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"


def read_binary(path: Path, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = read_bytes(path, MAX_RECORDS * RECORD)
    if len(data) == 0 or len(data) % RECORD:
        raise UserError(f"{path} has {len(data)} bytes, not a whole number of {RECORD}-byte CIFAR-100 records; "
                        "the file is truncated or corrupt, download it again")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD)
    targets = torch.from_numpy(records[:, 0 if labels == "coarse" else 1].astype(np.int64))
    if int(records[:, 0].max()) >= CLASSES["coarse"] or int(records[:, 1].max()) >= CLASSES["fine"]:
        raise UserError(f"{path} holds a label outside CIFAR-100's 20 coarse and 100 fine classes; it is not a "
                        "CIFAR-100 binary file")
    return torch.from_numpy(records[:, 2:].copy()).view(-1, 3, 32, 32), targets


def read_python(path: Path, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A python pickle: a dict whose 'data' is N x 3,072 uint8 and whose 'fine_labels' and 'coarse_labels'
    are N integers each."""
    key = f"{labels}_labels"
    try:
        if path.stat().st_size > MAX_PICKLE_BYTES:
            raise ValueError(f"{path.stat().st_size:,} bytes, more than any CIFAR-100 file")
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
        if not isinstance(batch, dict) or "data" not in batch or key not in batch:
            raise ValueError(f"it is not a dict with 'data' and '{key}'")
        data, targets = batch["data"], batch[key]
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
                and data.shape[1] == 3 * 32 * 32 and 0 < len(data) <= MAX_RECORDS):
            raise ValueError("'data' is not an N x 3072 array of uint8")
        if not (isinstance(targets, list) and len(targets) == len(data) and all(type(v) is int for v in targets)):
            raise ValueError(f"'{key}' are not one integer per image")
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
        target = torch.tensor(targets, dtype=torch.int64)
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError,
            OverflowError) as e:
        raise UserError(f"{path} is not a readable CIFAR-100 python file ({e}); download it again") from None
    if int(target.min()) < 0 or int(target.max()) >= CLASSES[labels]:
        raise UserError(f"{path} is not a CIFAR-100 file (a {labels} label outside 0..{CLASSES[labels] - 1}); "
                        "download it again")
    return images, target


def _layout(root: Path) -> tuple[str, Path] | None:
    for folder in (root, root / "cifar-100-binary"):
        if all((folder / f"{n}.bin").is_file() or (folder / f"{n}.bin.gz").is_file() for n in ("train", "test")):
            return "bin", folder
    for folder in (root, root / "cifar-100-python"):
        if all((folder / n).is_file() for n in ("train", "test")):
            return "py", folder
    return None


def load(data_dir: str, download: bool, val_size: int | None, labels: str = "fine") -> Splits:
    root = Path(data_dir)
    found = locate(root, download, _layout, ARCHIVES, URL, "CIFAR-100")
    if found is None:
        refuse_image_folder(root, "CIFAR-100")  # the likelier mistake, said first
        raise UserError(f"CIFAR-100 files (train and test, .bin/.bin.gz or python) not found in {root}; pass "
                        "--data-dir to the folder that holds them, or allow the download")
    kind, folder = found

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "py":
            return read_python(folder / name, labels)
        path = folder / f"{name}.bin"
        return read_binary(path if path.is_file() else folder / f"{name}.bin.gz", labels)

    train, test = read("train"), read("test")
    val = VAL_SIZE if val_size is None else val_size
    if val >= len(train[1]):
        raise UserError(f"--val-size {val} leaves no training examples (CIFAR-100 has {len(train[1])})")
    splits = hold_out("cifar100", train, test, val, MEAN, STD)
    return Splits(splits.name, splits.train, splits.val, splits.test, splits.mean, splits.std, CLASSES[labels])
