"""A torch Dataset of (image, label) pairs given to paratrain.fit: decoded once into a cache like an image
folder's (in the run folder, or under a key the user names), then split as a folder is."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import UserError
from .decode import channel_sums, private_name, progress_bar, put_in_place, square
from .folder import CACHE_VERSION, MAX_DEFAULT_SIZE, locked, seeded_rows, splits_of
from .splits import Splits


def _as_pil(image: Any) -> Any:
    """A Dataset's image (a PIL image, a uint8 or 0..1 float tensor C x H x W, or an H x W (x C) array)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, torch.Tensor):
        if image.dim() == 2:
            image = image[None]
        if image.dim() != 3:
            raise ValueError(f"a tensor image must be C x H x W, not {tuple(image.shape)}")
        if image.is_floating_point():
            if len(image) and (float(image.min()) < 0 or float(image.max()) > 1):
                raise ValueError("a float image must hold pixels in 0..1 (not normalised ones: paratrain "
                                 "normalises with the training set's statistics)")
            image = (image * 255).round()
        image = image.to(torch.uint8).permute(1, 2, 0).numpy()
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise ValueError(f"an array image must be uint8 H x W (x C), not {arr.dtype}")
    return Image.fromarray(arr[..., 0] if arr.ndim == 3 and arr.shape[2] == 1 else arr)


def from_dataset(dataset: Any, cache: Path, image_size: int | None, val_size: int | None,
                 test_size: int | None, reuse: bool, quiet: bool) -> Splits:
    """A map-style Dataset of (image, label) pairs decoded once into a cache at `cache` (reopened when `reuse`
    and it holds as many images), then split as a folder without split folders is."""
    n = len(dataset)
    if n < 3:
        raise UserError(f"your dataset has {n} item(s); it needs at least one each to train, validate and test")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with locked(cache, quiet):  # torchrun's ranks of one node build it once; the others wait, then open it
            manifest = _open_dataset_cache(cache, n, image_size, _fingerprint(dataset, n)) if reuse else None
            if manifest is None:
                manifest = _build_from_dataset(dataset, n, cache, image_size, quiet)
            return _held_out(cache, manifest, n, val_size, test_size)
    except OSError as e:
        raise UserError(f"cannot write the dataset's cache in {cache.parent} ({e.strerror or e}); set cache_dir "
                        "to a folder you can write") from None


def reopen(cache: Path, val_size: int | None, test_size: int | None) -> Splits | None:
    """The splits of a run's Dataset from its decoded cache alone (the Dataset itself not needed), held out as
    the run held them out; None where the cache is gone or no longer one."""
    found = _read_cache(cache)
    return None if found is None else _held_out(cache, found[0], found[1].shape[0], val_size, test_size)


def _held_out(cache: Path, manifest: dict, n: int, val_size: int | None, test_size: int | None) -> Splits:
    """A Dataset cache's splits: validation and test items held out by a seeded hash of their index."""
    rows = seeded_rows([str(i) for i in range(n)], val_size, test_size, "the dataset")
    return dataclasses.replace(splits_of(cache, manifest, rows, "custom", manifest["classes"]), split="index-hash")


def _fingerprint(dataset: Any, n: int) -> str:
    """A cheap mark of a Dataset's content (its first and last items), so that a cache of another Dataset of
    the same length is not taken for its own."""
    marks = []
    for i in (0, n - 1):
        image, label = _item(dataset, i)
        marks.append(image.tobytes() + str((image.size, image.mode, label)).encode())
    return hashlib.sha1(b"|".join(marks)).hexdigest()


def _read_cache(cache: Path) -> tuple[dict, np.ndarray] | None:
    """A Dataset cache's manifest and images (memory-mapped), where both are there and of this version and
    agree on the count; None otherwise."""
    try:
        manifest = json.loads((cache / "manifest.json").read_text())
        images = np.load(cache / "images.npy", mmap_mode="r")
    except (OSError, ValueError):
        return None
    ok = manifest.get("version") == CACHE_VERSION and manifest.get("count") == images.shape[0]
    return (manifest, images) if ok else None


def _open_dataset_cache(cache: Path, n: int, image_size: int | None, fingerprint: str) -> dict | None:
    found = _read_cache(cache)
    if found is None:
        return None
    manifest, images = found
    ok = images.shape[0] == n and image_size in (None, images.shape[-1]) and manifest.get("fingerprint") == fingerprint
    return manifest if ok else None


def _item(dataset: Any, i: int) -> tuple[Any, int]:
    try:
        image, label = dataset[i]
        one = label.numel() == 1 if isinstance(label, torch.Tensor) else np.size(label) == 1
        value = label.item() if isinstance(label, torch.Tensor | np.generic | np.ndarray) and one else label
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ValueError(f"the label {label!r} is not a class index")
        return _as_pil(image), int(value)
    except Exception as e:  # noqa: BLE001 (the user's Dataset may raise anything)
        raise UserError(f"item {i} of your dataset is not an (image, label) pair paratrain can read "
                        f"({type(e).__name__}: {e}); give PIL images, uint8 or 0..1 tensors, and int labels") \
            from None


def _build_from_dataset(dataset: Any, n: int, cache: Path, image_size: int | None, quiet: bool) -> dict:
    sample = [_item(dataset, i)[0] for i in range(min(n, 1000))]  # the size and colours, from the first items
    sides = sorted(min(im.size) for im in sample)
    side = image_size or min(sides[len(sides) // 2], MAX_DEFAULT_SIZE)
    channels = 1 if all(im.mode in ("1", "L", "I;16", "I", "F") for im in sample) else 3
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_name(cache, "building")
    tmp.mkdir()
    try:
        images = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8,
                                           shape=(n, channels, side, side))
        labels = np.zeros(n, dtype=np.int64)
        sums = np.zeros((n, channels, 2))
        bar = progress_bar(n, quiet)
        for i in range(n):
            im, labels[i] = _item(dataset, i)
            images[i] = arr = square(im, side, channels)
            sums[i] = channel_sums(arr)
            bar.update(1)
        bar.close()
        images.flush()
        del images
        if labels.min() < 0:
            raise UserError("your dataset has a negative label; labels must be class indices 0..K-1")
        names = getattr(dataset, "classes", None)
        k = int(labels.max()) + 1
        if len(np.unique(labels)) < 2:
            raise UserError(f"every item of your dataset has the label {int(labels[0])}; a classifier needs at "
                            "least two classes")
        classes = [str(c) for c in names] if isinstance(names, list | tuple) and len(names) >= k else \
            [str(c) for c in range(k)]
        np.save(tmp / "labels.npy", labels)
        np.save(tmp / "sums.npy", sums)
        manifest = {"version": CACHE_VERSION, "count": n, "classes": classes, "shape": [channels, side, side],
                    "fingerprint": _fingerprint(dataset, n)}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        put_in_place(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
