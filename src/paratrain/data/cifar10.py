"""CIFAR-10 from the binary version (data_batch_1..5.bin, test_batch.bin, plain or .gz) or the python
version (the pickled batches torchvision downloads), read into uint8 tensors.

The python batches are pickles; they are read with an unpickler that only builds numpy arrays, lists
and dicts, so a doctored file cannot run code.
"""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import UserError
from .fetch import refuse_image_folder, undone_on_failure
from .mnist import read_bytes
from .splits import Splits, hold_out

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
RECORD = 1 + 3 * 32 * 32  # label byte, then 1,024 red, 1,024 green, 1,024 blue
TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
VAL_SIZE = 5_000


MAX_RECORDS = 60_000  # a file of CIFAR-10's binary version holds 10,000 records; all 60,000 at most
MAX_PICKLE_BYTES = 200 * 2**20  # a python batch is 31 MB
# the official archives (https://www.cs.toronto.edu/~kriz/cifar.html): each unpacks to about 180 MB in 8 files
ARCHIVE_MD5 = {"cifar-10-binary.tar.gz": "c32a1d4ab5d03f1284b67883e8d87530",
               "cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a",
               "cifar-100-binary.tar.gz": "03b5dce01913d631647c71ecec9e9cb8",
               "cifar-100-python.tar.gz": "eb9058c3a382ffc7106e4002c42a8d85"}
MAX_ARCHIVE_BYTES, MAX_ARCHIVE_MEMBERS = 400 * 2**20, 64


def read_binary(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = read_bytes(path, MAX_RECORDS * RECORD)
    if len(data) == 0 or len(data) % RECORD:
        raise UserError(f"{path} has {len(data)} bytes, not a whole number of {RECORD}-byte CIFAR-10 "
                        "records; the file is truncated or corrupt, download it again")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD)
    labels = torch.from_numpy(records[:, 0].astype(np.int64))
    if int(labels.max()) > 9:
        raise UserError(f"{path} holds a label above 9; it is not a CIFAR-10 binary batch")
    images = torch.from_numpy(records[:, 1:].copy()).view(-1, 3, 32, 32)
    return images, labels


class _ArraysOnly(pickle.Unpickler):
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct")}

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_python(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A python batch: a dict whose 'data' is a uint8 array of N x 3,072 and whose 'labels' are N integers
    (anything else is refused before it is converted: a list may stand for gigabytes)."""
    try:
        if path.stat().st_size > MAX_PICKLE_BYTES:
            raise ValueError(f"{path.stat().st_size:,} bytes, more than any CIFAR-10 batch")
        with open(path, "rb") as f:
            batch = _ArraysOnly(f, encoding="latin1").load()
        if not isinstance(batch, dict) or "data" not in batch:
            raise ValueError("it is not a dict with 'data' and 'labels'")
        data, labels = batch["data"], batch.get("labels", batch.get("fine_labels"))
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
                and data.shape[1] == 3 * 32 * 32 and 0 < len(data) <= MAX_RECORDS):
            raise ValueError("'data' is not an N x 3072 array of uint8")
        if isinstance(labels, np.ndarray):
            labels = labels.tolist() if labels.ndim == 1 and labels.dtype.kind in "iu" else None
        if not (isinstance(labels, list) and len(labels) == len(data) and all(type(v) is int for v in labels)):
            raise ValueError("'labels' are not one integer per image")
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
        targets = torch.tensor(labels, dtype=torch.int64)
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError,
            OverflowError) as e:
        raise UserError(f"{path} is not a readable CIFAR-10 python batch ({e}); download it again") from None
    if int(targets.min()) < 0 or int(targets.max()) > 9:
        raise UserError(f"{path} is not a CIFAR-10 batch (a label outside 0..9); download it again")
    return images, targets


def _layout(root: Path) -> tuple[str, Path] | None:
    """Which version lies under root: ('bin', folder) or ('py', folder)."""
    for folder in (root, root / "cifar-10-batches-bin"):
        if all(_binary(folder, n) for n in [*TRAIN_BATCHES, "test_batch"]):
            return "bin", folder
    for folder in (root, root / "cifar-10-batches-py"):
        if all((folder / n).is_file() for n in [*TRAIN_BATCHES, "test_batch"]):
            return "py", folder
    return None


def _binary(folder: Path, name: str) -> Path | None:
    for suffix in (".bin", ".bin.gz"):
        if (folder / (name + suffix)).is_file():
            return folder / (name + suffix)
    return None


ARCHIVES = ("cifar-10-binary.tar.gz", "cifar-10-python.tar.gz")  # the two versions' official archives
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


def check_archive(archive: Path) -> None:
    """An archive in the data folder is extracted only if it is the official one (its MD5)."""
    from torchvision.datasets.utils import calculate_md5

    try:
        digest = calculate_md5(archive)
    except OSError as e:
        raise UserError(f"{archive} cannot be read ({e.strerror or e}); download it again") from None
    if digest != ARCHIVE_MD5[archive.name]:
        raise UserError(f"{archive} is not the official archive (its MD5 is {digest}, not "
                        f"{ARCHIVE_MD5[archive.name]}); delete it and download it again")


def extract_safely(archive: Path, dest: Path) -> None:
    """Unpack a tar archive with the standard library's 'data' filter: no member may land outside dest,
    be a device, or link outside it; at most MAX_ARCHIVE_MEMBERS members and MAX_ARCHIVE_BYTES in all (a
    crafted archive is refused, not half-extracted)."""
    import tarfile

    if not hasattr(tarfile, "data_filter"):  # added in Python 3.10.12 and 3.11.4
        raise UserError(f"this Python cannot extract {archive} safely; extract it yourself, or use Python 3.11.4+")
    try:
        with tarfile.open(archive) as tar:
            members = []
            for m in tar:  # read member by member: a bomb of empty members stops at the count
                members.append(m)
                if len(members) > MAX_ARCHIVE_MEMBERS:
                    raise UserError(f"{archive} has more than {MAX_ARCHIVE_MEMBERS} members, which no CIFAR "
                                    "archive has; refusing to extract it. Download the official archive again")
            total = sum(m.size for m in members)
            if total > MAX_ARCHIVE_BYTES:
                raise UserError(f"{archive} would unpack to {total:,} bytes, more than any CIFAR archive; "
                                "refusing to extract it. Download the official archive again")
            for m in members:  # check every member first, so nothing is written from a bad archive
                tarfile.data_filter(m, str(dest))
            tar.extractall(dest, members=members, filter="data")
    except tarfile.FilterError as e:
        raise UserError(f"{archive} has an unsafe member ({e}); refusing to extract it. Download the "
                        "official archive again") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise UserError(f"{archive} is not a readable tar archive ({e}); download it again") from None


def fetch_archive(root: Path, url: str, name: str, title: str) -> None:
    """Download a CIFAR archive (torchvision checks its MD5); a failed one is not kept."""
    from torchvision.datasets.utils import download_url

    try:
        with undone_on_failure(root):
            download_url(url, str(root), name, ARCHIVE_MD5[name])  # checks the archive's MD5
    except Exception as e:  # network errors come in many types; all mean the same to the user
        (root / name).unlink(missing_ok=True)  # a download that failed its MD5 is not kept
        raise UserError(f"could not download {title} into {root} ({type(e).__name__}: {e}); "
                        "put its files there and pass --data-dir") from None


def locate(root: Path, download: bool, layout: Any, archives: tuple[str, ...], url: str, title: str) -> Any:
    """Where a CIFAR version lies under root (`layout(root)`), downloading the python archive when nothing
    is there and extracting an official archive that is; None if neither."""
    found = layout(root)
    if found is None and download and not any((root / a).is_file() for a in archives):
        refuse_image_folder(root, title)
        fetch_archive(root, url, archives[1], title)
    for archive in (root / a for a in archives):
        if found is None and archive.is_file():
            check_archive(archive)
            extract_safely(archive, root)
            found = layout(root)
    return found


def load(data_dir: str, download: bool, val_size: int | None) -> Splits:
    root = Path(data_dir)
    found = locate(root, download, _layout, ARCHIVES, URL, "CIFAR-10")
    if found is None:
        refuse_image_folder(root, "CIFAR-10")  # the likelier mistake, said first
        raise UserError(f"CIFAR-10 batches (data_batch_1..5 and test_batch, .bin/.bin.gz or python) "
                        f"not found in {root}; pass --data-dir to the folder that holds them, "
                        "or allow the download")
    kind, folder = found

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return read_binary(_binary(folder, name)) if kind == "bin" else read_python(folder / name)

    parts = [read(n) for n in TRAIN_BATCHES]
    train = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    test = read("test_batch")
    val = VAL_SIZE if val_size is None else val_size
    if val >= len(train[1]):
        raise UserError(f"--val-size {val} leaves no training examples (CIFAR-10 has {len(train[1])})")
    return hold_out("cifar10", train, test, val, MEAN, STD)
