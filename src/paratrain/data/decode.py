"""Decoding an image folder's files into the cache: each image read, resized on its shorter side and
centre-cropped square (torchvision's Resize + CenterCrop), in chunks over a pool of processes; the cache's
folder written under a private name and renamed into place; its channel statistics."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np


def decode_image(path: str, side: int, channels: int) -> np.ndarray | str:
    """One image file as C x side x side uint8, or why it failed."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return square(im, side, channels)
    except Exception as e:  # noqa: BLE001 (PIL fails on a bad file in many ways)
        return f"{type(e).__name__}: {e}"


def square(im: Any, side: int, channels: int) -> np.ndarray:
    """A PIL image as C x side x side uint8: resized (bilinear, antialiased) so that its shorter side is
    `side`, then centre-cropped, with the sizes and offsets torchvision's Resize and CenterCrop compute
    (PIL alone: the decoding processes need not import torch)."""
    from PIL import Image

    im = im.convert("L" if channels == 1 else "RGB")
    w, h = im.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(side * long / short)
    im = im.resize((side, new_long) if w <= h else (new_long, side), Image.BILINEAR)
    w, h = im.size
    top, left = int(round((h - side) / 2.0)), int(round((w - side) / 2.0))
    arr = np.asarray(im.crop((left, top, left + side, top + side)), dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def probe_image(path: str) -> tuple[int, str] | str:
    """An image's shorter side and mode from its header (no decoding), or why it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return min(im.size), im.mode
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def probe_many(paths: list[str]) -> list[tuple[int, str] | str]:
    return [probe_image(p) for p in paths]


def decode_many(paths: list[str], side: int, channels: int) -> list[np.ndarray | str]:
    return [decode_image(p, side, channels) for p in paths]


def private_name(folder: Path, what: str) -> Path:
    """A sibling of `folder` that no other process (on this machine or another one sharing the disk) uses."""
    import socket
    import uuid

    return folder.parent / f".{folder.name}.{what}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def put_in_place(tmp: Path, folder: Path) -> None:
    """Rename a finished build to `folder`, moving an older cache aside first (readers that opened it keep
    their open files)."""
    old = private_name(folder, "old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


class Inline:
    """A pool of one: map in this process."""

    def map(self, fn, *iterables):  # noqa: ANN001, ANN002, ANN201
        return map(fn, *iterables)

    def __enter__(self) -> Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress_bar(total: int, quiet: bool):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=total, unit="img", desc="decoding images", disable=quiet or not sys.stderr.isatty(),
                file=sys.stderr)


# ---- the splits ----

def channel_sums(image: np.ndarray) -> np.ndarray:
    """One C x H x W uint8 image's per-channel sum and sum of squares on the 0..1 scale (C x 2, float64)."""
    unit = image.reshape(image.shape[0], -1).astype(np.float64) / 255
    return np.stack([unit.sum(1), (unit * unit).sum(1)], axis=1)


def statistics(sums: np.ndarray, pixels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (unbiased) standard deviation on the 0..1 scale, in float64, from the images'
    per-channel sums and sums of squares (saved with the cache): no image is read."""
    total = sums.sum(axis=0)  # C x 2
    count = len(sums) * pixels
    mean = total[:, 0] / count
    var = np.maximum(total[:, 1] / count - mean * mean, 0.0) * count / max(count - 1, 1)
    return tuple(mean.tolist()), tuple(np.sqrt(var).tolist())


def decode_into(tmp: Path, pool: Any, paths: list[str], bad: dict[int, str], good: list[int],
                 shape: tuple[int, int], quiet: bool) -> np.ndarray:
    """Decode `paths` (the images that probed well, numbered `good` in the listing) into tmp/images.npy, each
    at `shape` (channels, side); one that fails only now is added to `bad`. Their per-channel sums."""
    channels, side = shape
    images = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8,
                                       shape=(len(paths), channels, side, side))
    sums = np.zeros((len(paths), channels, 2))  # per image and channel: sum, sum of squares (0..1)
    bar = progress_bar(len(paths), quiet)
    pieces = chunks(len(paths), 64)
    results = pool.map(decode_many, [[paths[i] for i in c] for c in pieces],
                       [side] * len(pieces), [channels] * len(pieces))
    for piece, decoded in zip(pieces, results, strict=True):
        for i, arr in zip(piece, decoded, strict=True):
            if isinstance(arr, str):  # the header read but the pixels did not: truncated data
                bad[good[i]] = arr
                continue
            images[i] = arr
            sums[i] = channel_sums(arr)
        bar.update(len(piece))
    bar.close()
    images.flush()
    return sums


def keep_rows(tmp: Path, keep: np.ndarray) -> None:
    """Drop from tmp/images.npy the rows of images that failed only when decoded, a chunk at a time (the set
    may not fit in memory)."""
    full = np.load(tmp / "images.npy", mmap_mode="r")
    kept_rows = np.lib.format.open_memmap(tmp / "kept.npy", mode="w+", dtype=np.uint8,
                                          shape=(len(keep), *full.shape[1:]))
    for start in range(0, len(keep), 4096):
        kept_rows[start:start + 4096] = full[keep[start:start + 4096]]
    kept_rows.flush()
    del full, kept_rows
    os.replace(tmp / "kept.npy", tmp / "images.npy")
