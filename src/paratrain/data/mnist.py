"""MNIST, and the sets published in its IDX format (Fashion-MNIST, KMNIST), from the original files (plain or
.gz), downloaded through torchvision (which checks their MD5s) when missing.

The split is the classic tutorial's: the first 5,000 training images validate, 55,000 train, and the
10,000 test images test.
"""

from __future__ import annotations

import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..core.errors import UserError
from .fetch import refuse_image_folder, undone_on_failure
from .splits import Splits, hold_out

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MEAN, STD = (0.1307,), (0.3081,)


@dataclass(frozen=True)
class Family:
    """A dataset in MNIST's IDX format: its name in messages, torchvision's class (and folder) for it, and
    the per-channel statistics of its training images."""

    title: str
    torchvision_name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


FAMILIES = {
    "mnist": Family("MNIST", "MNIST", MEAN, STD),
    "fashion-mnist": Family("Fashion-MNIST", "FashionMNIST", (0.2860,), (0.3530,)),
    "kmnist": Family("KMNIST", "KMNIST", (0.1918,), (0.3483,)),
}
VAL_SIZE = 5_000
# IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
_MAGIC = {3: b"\x00\x00\x08\x03", 1: b"\x00\x00\x08\x01"}


# ---- reading files whose size a header promises: never more than that, never before checking it ----

MAX_IMAGES = 60_000  # MNIST's (and Fashion-MNIST's) training file: 47 MB of images at most
MAX_BYTES = MAX_IMAGES * 28 * 28


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # noqa: SIM115


def _read_exactly(f: BinaryIO, n: int, path: Path) -> bytes:
    """`n` bytes of `f` and nothing after them (read in pieces: a gzip stream's length is unknown)."""
    data = f.read(n)
    if len(data) != n:
        raise UserError(f"{path} is shorter than its header promises ({len(data)} of {n} bytes after it); "
                        "the file is truncated or corrupt, download it again")
    if f.read(1):
        raise UserError(f"{path} holds more than its header promises; the file is corrupt, download it again")
    return data


def read_bytes(path: Path, limit: int) -> bytes:
    """A file's bytes, gunzipped when it ends in .gz, refused past `limit` bytes (a gzip bomb stops
    there); a corrupt file is a UserError naming it."""
    try:
        with _open(path) as f:
            data = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"{path} is corrupt or truncated ({e}); delete it and download it again") from None
    if len(data) > limit:
        raise UserError(f"{path} holds more than {limit:,} bytes, more than any file of its dataset; "
                        "it is not the dataset's file, download it again")
    return data


def read_idx(path: Path, ndim: int, item_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Parse an IDX file of unsigned bytes with `ndim` dimensions: the header first (magic, then the sizes,
    checked against the format's limits, `item_shape` where given, and the file's size), then exactly the
    bytes it promises."""
    header = 4 + 4 * ndim
    try:
        with _open(path) as f:
            head = f.read(header)
            if len(head) < header or head[:4] != _MAGIC[ndim]:
                raise UserError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (wrong magic number); "
                                "use the original files of the dataset")
            dims = [int.from_bytes(head[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]  # Python ints
            expected = tuple(dims[1:]) if item_shape is None else item_shape
            size = math.prod(dims)
            if tuple(dims[1:]) != expected or not 0 < dims[0] <= MAX_IMAGES or size > MAX_BYTES:
                shape = " x ".join(map(str, expected)) or "one label"
                raise UserError(f"{path}: its header describes {' x '.join(map(str, dims))}, not up to "
                                f"{MAX_IMAGES:,} items of {shape}; use the original files of the dataset")
            if path.suffix != ".gz" and path.stat().st_size != header + size:
                raise UserError(f"{path} has {path.stat().st_size} bytes but its header promises {header + size}; "
                                "the file is truncated or corrupt, download it again")
            data = _read_exactly(f, size, path)
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"{path} is corrupt or truncated ({e}); delete it and download it again") from None
    array = np.frombuffer(data, dtype=np.uint8).reshape(dims)
    return torch.from_numpy(array.copy())


def _find(root: Path, stem: str, family: Family) -> Path | None:
    for folder in (root, root / family.torchvision_name / "raw", root / family.title.lower()):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def _download(root: Path, family: Family) -> None:
    import torchvision

    try:
        with undone_on_failure(root, family.torchvision_name):
            for train in (True, False):  # torchvision checks each file's MD5
                getattr(torchvision.datasets, family.torchvision_name)(str(root), train=train, download=True)
    except Exception as e:  # network errors come in many types; all mean the same to the user
        raise UserError(f"could not download {family.title} into {root} ({type(e).__name__}: {e}); "
                        "copy the four IDX files there and pass --data-dir") from None


def _check_family(train_x: torch.Tensor, family: Family, root: Path) -> None:
    """The three sets share their file names: a full training file whose mean pixel is another family's
    (to 0.005, where theirs lie 0.06 and more apart) is that family's, not the one asked for."""
    if len(train_x) != MAX_IMAGES:
        return
    mean = train_x.sum(dtype=torch.int64).item() / train_x.numel() / 255  # no float copy of 47 MB
    other = next((f for f in FAMILIES.values() if abs(mean - f.mean[0]) < 0.005), family)
    if other is not family:
        flag = next(k for k, f in FAMILIES.items() if f is other)
        raise UserError(f"the files in {root} hold {other.title}, not {family.title} (their mean pixel is "
                        f"{other.title}'s); pass --dataset {flag}, or --data-dir to {family.title}'s files")


def load(data_dir: str, download: bool, val_size: int | None, name: str = "mnist") -> Splits:
    family, root = FAMILIES[name], Path(data_dir)
    paths = {key: _find(root, stem, family) for key, stem in FILES.items()}
    missing = [FILES[k] for k, p in paths.items() if p is None]
    if missing and download:
        refuse_image_folder(root, family.title)
        _download(root, family)
        paths = {key: _find(root, stem, family) for key, stem in FILES.items()}
        missing = [FILES[k] for k, p in paths.items() if p is None]
    if missing:
        refuse_image_folder(root, family.title)  # the likelier mistake, said first
        raise UserError(f"{family.title} file(s) {', '.join(missing)} (or .gz) not found in {root}; "
                        "pass --data-dir to the folder that holds them, or allow the download")
    train_x, train_y = read_idx(paths["train_images"], 3, (28, 28)), read_idx(paths["train_labels"], 1)
    test_x, test_y = read_idx(paths["test_images"], 3, (28, 28)), read_idx(paths["test_labels"], 1)
    for (x, y), kind in (((train_x, train_y), "train"), ((test_x, test_y), "test")):
        if len(x) != len(y):
            raise UserError(f"{family.title} {kind} images ({len(x)}) and labels ({len(y)}) differ in count; "
                            "the files do not belong together, download them again")
        if len(y) and int(y.max()) > 9:
            raise UserError(f"{family.title} {kind} labels hold a class above 9; the label file is corrupt")
    _check_family(train_x, family, root)
    val = VAL_SIZE if val_size is None else val_size
    if val >= len(train_y):
        raise UserError(f"--val-size {val} leaves no training examples ({family.title} has {len(train_y)})")
    return hold_out(name, (train_x.unsqueeze(1), train_y.long()), (test_x.unsqueeze(1), test_y.long()),
                    val, family.mean, family.std)
