"""MNIST from the original IDX files (plain or .gz), downloaded through torchvision when missing.

The split is the classic tutorial's: the first 5,000 training images validate, 55,000 train, and the
10,000 test images test.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .splits import Splits, hold_out

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MEAN, STD = (0.1307,), (0.3081,)
VAL_SIZE = 5_000
# IDX magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
_MAGIC = {3: b"\x00\x00\x08\x03", 1: b"\x00\x00\x08\x01"}


def read_bytes(path: Path) -> bytes:
    """A file's bytes, gunzipped when it ends in .gz; a corrupt file is a UserError naming it."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"{path} is corrupt or truncated ({e}); delete it and download it again") from None


def read_idx(path: Path, ndim: int) -> torch.Tensor:
    """Parse an IDX file of unsigned bytes with `ndim` dimensions, checking magic and size."""
    data = read_bytes(path)
    header = 4 + 4 * ndim
    if len(data) < header or data[:4] != _MAGIC[ndim]:
        raise UserError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (wrong magic number); "
                        "use the original MNIST files")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(data) != expected:
        raise UserError(f"{path} has {len(data)} bytes but its header promises {expected}; "
                        "the file is truncated or corrupt, download it again")
    array = np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)
    return torch.from_numpy(array.copy())


def _find(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "MNIST" / "raw", root / "mnist"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def _download(root: Path) -> None:
    import torchvision

    try:
        for train in (True, False):  # torchvision checks each file's MD5
            torchvision.datasets.MNIST(str(root), train=train, download=True)
    except Exception as e:  # network errors come in many types; all mean the same to the user
        raise UserError(f"could not download MNIST into {root} ({type(e).__name__}: {e}); "
                        "copy the four IDX files there and pass --data-dir") from None


def load(data_dir: str, download: bool, val_size: int | None) -> Splits:
    root = Path(data_dir)
    paths = {key: _find(root, stem) for key, stem in FILES.items()}
    missing = [FILES[k] for k, p in paths.items() if p is None]
    if missing and download:
        _download(root)
        paths = {key: _find(root, stem) for key, stem in FILES.items()}
        missing = [FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise UserError(f"MNIST file(s) {', '.join(missing)} (or .gz) not found in {root}; "
                        "pass --data-dir to the folder that holds them, or allow the download")
    train_x, train_y = read_idx(paths["train_images"], 3), read_idx(paths["train_labels"], 1)
    test_x, test_y = read_idx(paths["test_images"], 3), read_idx(paths["test_labels"], 1)
    for (x, y), kind in (((train_x, train_y), "train"), ((test_x, test_y), "test")):
        if len(x) != len(y):
            raise UserError(f"MNIST {kind} images ({len(x)}) and labels ({len(y)}) differ in count; "
                            "the files do not belong together, download them again")
        if len(y) and int(y.max()) > 9:
            raise UserError(f"MNIST {kind} labels hold a class above 9; the label file is corrupt")
    val = VAL_SIZE if val_size is None else val_size
    if val >= len(train_y):
        raise UserError(f"--val-size {val} leaves no training examples (MNIST has {len(train_y)})")
    return hold_out("mnist", (train_x.unsqueeze(1), train_y.long()), (test_x.unsqueeze(1), test_y.long()),
                    val, MEAN, STD)
