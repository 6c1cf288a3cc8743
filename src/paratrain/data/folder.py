"""Image folders (torchvision's ImageFolder layout: a sub-folder per class), decoded once into a uint8 cache.

    DIR/train/<class>/*.png, DIR/val/..., DIR/test/...   the splits where they exist
    DIR/<class>/*.jpg                                     otherwise: one seeded split by --val-size, --test-size

The first run decodes every image (in parallel over the cores), resizes it on its shorter side to
--image-size and centre-crops it square (as torchvision's Resize + CenterCrop do), and writes one
memory-mappable `images.npy` with `labels.npy` and a manifest of the files (size and mtime each). Later runs
check the manifest against the folder and open the cache without decoding; a changed, added or removed file
rebuilds it. A build writes into a fresh folder and renames it into place: an interrupted or failed build
never replaces a good cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.errors import UserError
from ..runtime.devices import usable_cores
from ..runtime.env import user_cache
from .decode import (
    Inline,
    chunks,
    decode_into,
    keep_rows,
    private_name,
    probe_many,
    put_in_place,
    statistics,
)
from .source import MappedImages
from .splits import Splits

CACHE_VERSION = 1  # of the files below: a cache of another version is rebuilt
MAX_DEFAULT_SIZE = 224
PARALLEL_FROM = 5_000  # images: below this a folder is decoded in this process
SPLIT_SEED = 0  # the held-out split does not move with --seed: test accuracies of two runs compare
SPLIT_SCHEME = "name-hash"  # how the held-out sets are chosen; runs of an earlier scheme are not resumed
SPLITS = ("train", "val", "test")


GRAY_MODES = ("1", "L", "I;16", "I", "F")  # PIL modes of one channel: a folder of only these is decoded gray


@dataclass(frozen=True)
class Listing:
    """The image files of a folder in a fixed order, with their class, and which split each one is in."""

    root: Path
    classes: list[str]
    files: list[str]  # relative to root, sorted by split then class then name
    labels: np.ndarray  # int64, one per file
    split_of: dict[str, np.ndarray]  # "train"/"val"/"test" -> indices into files (for folders with splits)


def list_folder(root: Path) -> Listing:
    """The images of an ImageFolder tree (or of train/val/test trees under it); a folder that is not one is
    one line that says what is wrong."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if not root.is_dir():
        raise UserError(f"--data-dir {root} is not a folder; give a folder with a sub-folder of images per class")
    split_dirs = {s: root / s for s in SPLITS if (root / s).is_dir()}
    if split_dirs and "train" not in split_dirs:
        raise UserError(f"{root} has {', '.join(split_dirs)} but no train/ folder; add one, or put the class "
                        "folders directly in it")
    trees = split_dirs or {"all": root}
    classes = _classes(trees.get("train", root))
    files: list[str] = []
    labels: list[int] = []
    split_of: dict[str, np.ndarray] = {}
    for split, tree in trees.items():
        start = len(files)
        for k, name in enumerate(classes):
            folder = tree / name
            found = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file()) \
                if folder.is_dir() else []
            if split in ("train", "all") and not found:
                raise UserError(f"class folder {folder} has no images ({', '.join(IMG_EXTENSIONS)}); add some, or "
                                "remove the folder")
            files += [str(p.relative_to(root)) for p in found]
            labels += [k] * len(found)
        extra = sorted(e.name for e in os.scandir(tree) if e.is_dir() and e.name not in classes
                       and not e.name.startswith(".")) if split != "all" else []
        if extra:
            raise UserError(f"{tree} has class folders that train/ has not ({', '.join(extra[:5])}); every split "
                            "must use the training set's classes")
        split_of[split] = np.arange(start, len(files))
    return Listing(root, classes, files, np.asarray(labels, dtype=np.int64), split_of)


def _classes(tree: Path) -> list[str]:
    classes = sorted(e.name for e in os.scandir(tree) if e.is_dir() and not e.name.startswith("."))
    if len(classes) < 2:
        found = f"only the class folder '{classes[0]}'" if classes else "no class folders"
        raise UserError(f"{tree} has {found}; an image folder needs a sub-folder of images for each of at least "
                        "two classes (DIR/cat/*.jpg, DIR/dog/*.jpg)")
    return classes


# ---- the cache ----

def stamp(root: Path, files: list[str]) -> list[list]:
    """What identifies each file's content cheaply: its size and modification time."""
    out = []
    for f in files:
        st = (root / f).stat()
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def cache_folder(root: Path, image_size: int | None, cache_dir: str | None) -> Path:
    """Where the cache of `root` at `image_size` lives: under --cache-dir, else in the user's cache folder.
    Never in the data folder: a folder of its own there would be one more class to torchvision's
    ImageFolder (and to any tool that lists the classes' folders)."""
    key = hashlib.sha1(f"{root.resolve()}|{image_size}".encode()).hexdigest()[:16]
    return (Path(cache_dir).expanduser() if cache_dir else user_cache() / "folders") / key


def dataset_cache(key: str, cache_dir: str | None, image_size: int | None) -> Path:
    """Where a Dataset's cache named `key` at `image_size` lives: under --cache-dir, else the user's cache
    folder (each size apart, so that runs of two sizes do not rebuild one cache under each other)."""
    import re

    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", key):
        raise UserError(f"cache_key {key!r} must be a plain name (letters, digits, -, _ or .), not a path")
    base = Path(cache_dir).expanduser() if cache_dir else user_cache()
    return base / "datasets" / key / (str(image_size) if image_size else "auto")


def open_cache(folder: Path, stamps: list[list]) -> dict | None:
    """The cache's manifest if it is complete and was built from exactly these files, else None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("version") != CACHE_VERSION or manifest.get("files") != stamps:
        return None
    n = len(manifest.get("kept", []))
    try:  # a truncated or damaged file is rebuilt
        images, labels, sums = (np.load(folder / f, mmap_mode="r") for f in ("images.npy", "labels.npy", "sums.npy"))
    except (OSError, ValueError):
        return None
    if images.shape != (n, *manifest["shape"]) or labels.shape != (n,) or sums.shape[0] != n:
        return None
    return manifest


def build_cache(listing: Listing, stamps: list[list], folder: Path, image_size: int | None, skip_bad: bool,
                workers: int, quiet: bool) -> dict:
    """Decode every image into a new cache folder, then rename it into place; returns its manifest."""
    root, n = listing.root, len(listing.files)
    paths = [str(root / f) for f in listing.files]
    ranges = chunks(n, 64)
    t0 = time.perf_counter()
    # Decoding processes are spawned (this process has torch's threads: forking it is unsafe); one worker
    # decodes here, without a pool.
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) \
        if workers > 1 else Inline()
    with pool:
        probes = [r for part in pool.map(probe_many, [[paths[i] for i in c] for c in ranges]) for r in part]
        bad = {i: r for i, r in enumerate(probes) if isinstance(r, str)}
        refuse_bad(bad, listing, skip_bad)
        good = [i for i in range(n) if i not in bad]
        if not good:
            raise UserError(f"none of the {n} images in {root} can be read; see the manifest of a build with "
                            "--skip-bad-images, or check the files")
        sides = sorted(probes[i][0] for i in good)
        side = image_size or min(sides[len(sides) // 2], MAX_DEFAULT_SIZE)
        channels = 1 if all(probes[i][1] in GRAY_MODES for i in good) else 3
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = private_name(folder, "building")
        tmp.mkdir()
        try:
            sums = decode_into(tmp, pool, [paths[i] for i in good], bad, good, (channels, side), quiet)
            if bad and not skip_bad:
                refuse_bad(bad, listing, skip_bad)
            keep = np.asarray([i for i in range(len(good)) if good[i] not in bad], dtype=np.int64)
            if len(keep) != len(good):  # images that failed only when decoded: drop their rows
                keep_rows(tmp, keep)
            kept = [good[i] for i in keep]
            np.save(tmp / "labels.npy", listing.labels[kept])
            np.save(tmp / "sums.npy", sums[keep])  # any split's statistics, without reading its images
            manifest = {"version": CACHE_VERSION, "root": str(root.resolve()), "classes": listing.classes,
                        "shape": [channels, side, side], "files": stamps, "kept": kept,
                        "skipped": {listing.files[i]: why for i, why in sorted(bad.items())},
                        "built_s": round(time.perf_counter() - t0, 3)}
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            put_in_place(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    rate = n / max(time.perf_counter() - t0, 1e-9)
    if not quiet:
        print(f"paratrain: decoded {len(kept)} images of {root} into {folder} at {rate:.0f} images/s"
              + (f"; skipped {len(bad)} bad images (listed in its manifest.json)" if bad else ""),
              file=sys.stderr, flush=True)
    return manifest


def refuse_bad(bad: dict[int, str], listing: Listing, skip_bad: bool) -> None:
    if bad and not skip_bad:
        i = min(bad)
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(f"{listing.root / listing.files[i]} is not a readable image ({bad[i][:120]}){more}; "
                        "remove or replace it, or pass --skip-bad-images to leave bad images out")


def held_out(keys: list[str], val_size: int, test_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A seeded split of examples named by `keys` (file paths, item numbers) into train, val and test
    positions (each sorted). Each example's place follows a hash of its name, not its position: with the
    held-out sizes fixed, an image added to a folder takes a place in at most one held-out set, and at most
    one image leaves each (the test set stays nearly the same)."""
    def place(i: int) -> bytes:
        return hashlib.sha1(f"{SPLIT_SEED}|{keys[i]}".encode()).digest()

    perm = np.asarray(sorted(range(len(keys)), key=place), dtype=np.int64)
    test, val, train = perm[:test_size], perm[test_size:test_size + val_size], perm[test_size + val_size:]
    return np.sort(train), np.sort(val), np.sort(test)


def load(root: str, image_size: int | None = None, val_size: int | None = None, test_size: int | None = None,
         cache_dir: str | None = None, skip_bad: bool = False, workers: int | None = None,
         quiet: bool = False) -> Splits:
    """The folder's splits, read from its cache (built first if missing or stale)."""
    listing = list_folder(Path(root))
    stamps = stamp(listing.root, listing.files)
    folder = cache_folder(listing.root, image_size, cache_dir)
    if image_size is not None:  # the cache of the default size may already be of this size (paratrain eval)
        median = cache_folder(listing.root, None, cache_dir)
        found = open_cache(median, stamps)
        if found is not None and found["shape"][-1] == image_size:
            folder = median
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # One build at a time (torchrun's ranks, two runs): the others wait, then open it. The files are read
        # under the lock too, so that another run's rebuild cannot slip in between the images and the labels.
        with locked(folder, quiet):
            manifest = open_cache(folder, stamps)
            if manifest is None:
                # Spawning the decoding processes costs seconds (each imports torch): worth it for thousands
                # of images (benchmarks/image_cache.py: 1,500 small PNGs decoded faster in this process)
                default = usable_cores() if len(listing.files) >= PARALLEL_FROM else 1
                manifest = build_cache(listing, stamps, folder, image_size, skip_bad, workers or default, quiet)
            return splits_of(folder, manifest, folder_rows(listing, manifest, root, val_size, test_size, skip_bad),
                           "imagefolder", listing.classes)
    except BrokenProcessPool:  # a decoding process died: most often a script that calls fit when imported
        raise UserError("a process decoding the images stopped; if you call paratrain.fit from a script, put the "
                        'call under `if __name__ == "__main__":` (the decoding processes import it again)') from None
    except OSError as e:
        raise UserError(f"cannot write the image cache in {folder.parent} ({e.strerror or e}); pass --cache-dir "
                        "DIR with a folder you can write") from None


def folder_rows(listing: Listing, manifest: dict, root: str, val_size: int | None, test_size: int | None,
                 skip_bad: bool) -> dict[str, np.ndarray]:
    """The cache rows of each split: the split folders', or held out by a seeded hash of the file names."""
    if manifest["skipped"] and not skip_bad:  # built with --skip-bad-images: without it, stop as a build would
        first, why = next(iter(manifest["skipped"].items()))
        raise UserError(f"{listing.root / first} is not a readable image ({why[:120]}); remove or replace it, or "
                        "pass --skip-bad-images to leave bad images out")
    kept = np.asarray(manifest["kept"], dtype=np.int64)
    position = {int(f): i for i, f in enumerate(kept)}  # file index -> row of the cache
    if "all" in listing.split_of:
        return seeded_rows([listing.files[i] for i in kept], val_size, test_size, root)
    rows = {s: np.asarray([position[int(i)] for i in listing.split_of.get(s, []) if int(i) in position],
                          dtype=np.int64) for s in SPLITS}
    # no val/ or test/ folder: held out of train/ (a tenth each, or --val-size, --test-size)
    n = len(rows["train"])
    val_n = 0 if "val" in listing.split_of else n // 10 if val_size is None else val_size
    test_n = 0 if "test" in listing.split_of else n // 10 if test_size is None else test_size
    if val_n + test_n >= n:
        raise UserError(f"holding out {val_n} images for validation and {test_n} for testing leaves none of "
                        f"the {n} in {root}/train to train on; lower --val-size or --test-size")
    names = [listing.files[kept[r]] for r in rows["train"]]
    train, val, test = (rows["train"][p] for p in held_out(names, val_n, test_n))
    rows["train"] = train
    if "val" not in listing.split_of:
        rows["val"] = val
    if "test" not in listing.split_of:
        rows["test"] = test
    return rows


@contextlib.contextmanager
def locked(folder: Path, quiet: bool = True) -> Iterator[None]:
    """An exclusive lock on `folder`'s lock file (flock: released if the process dies); says so when it
    waits for another process (unless `quiet`)."""
    import errno

    # Read-only is enough for flock: a cache folder the user may only read (already built) still opens.
    try:
        fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError:
        fd = -1
    try:
        if fd >= 0:
            try:
                wait_for_lock(fd, folder, quiet)
            except OSError as e:  # a filesystem without locks (NFS mounted nolock, some parallel ones)
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EACCES, errno.EROFS):
                    raise
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # closing releases the lock


def wait_for_lock(fd: int, folder: Path, quiet: bool) -> None:
    """flock, saying so once a wait passes a second (a build elsewhere; not the brief turn of a reader)."""
    import fcntl

    start, said = time.monotonic(), quiet
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said and time.monotonic() - start > 1.0:
                print(f"paratrain: waiting for another process that builds the image cache {folder}",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.05)


def seeded_rows(keys: list[str], val_size: int | None, test_size: int | None, where: str) -> dict[str, np.ndarray]:
    n = len(keys)
    val_n = n // 10 if val_size is None else val_size
    test_n = n // 10 if test_size is None else test_size
    if val_n + test_n >= n:
        raise UserError(f"--val-size {val_n} and --test-size {test_n} leave no training images of the {n} in "
                        f"{where}; lower them")
    return dict(zip(SPLITS, held_out(keys, val_n, test_n), strict=True))


def splits_of(folder: Path, manifest: dict, rows: dict[str, np.ndarray], name: str, classes: list[str]) -> Splits:
    """The splits `rows` of a cache, normalised with the statistics of its training rows."""
    images = MappedImages(str(folder / "images.npy"))
    labels = torch.from_numpy(np.load(folder / "labels.npy"))
    pairs = {s: (images.subset(r), labels[torch.from_numpy(r)]) for s, r in rows.items()}
    side = manifest["shape"][-1]
    mean, std = statistics(np.load(folder / "sums.npy")[rows["train"]], side * side)
    return Splits(name, pairs["train"], pairs["val"], pairs["test"], mean, std, len(classes),
                  classes=tuple(classes), split=SPLIT_SCHEME)


# ---- a map-style Dataset of the user's ----
