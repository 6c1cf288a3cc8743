"""Downloads that fail leave nothing behind: bad input (a wrong --data-dir, no network) writes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import UserError


@contextmanager
def undone_on_failure(root: Path, *inside: str) -> Iterator[None]:
    """Run a download into `root`; if it fails, remove the folders it made: `root` and its parents where they
    did not exist before, and the sub-folders `inside` (torchvision's MNIST/raw) that it created."""
    made = [p for p in [*(root / name for name in inside), root, *root.parents] if not p.exists()]
    try:
        yield
    except BaseException:
        for path in made:  # deepest first: the download's own folders, then the ones above them
            if path == root or path in [root / name for name in inside]:
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    path.rmdir()
                except OSError:  # not empty: something else put files there meanwhile
                    pass
        raise


def refuse_image_folder(root: Path, title: str) -> None:
    """Before a download into `root`: a folder of class sub-folders of images is the user's own data, given
    with the wrong --dataset; downloading beside it would mix a dataset into it."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if not root.is_dir():
        return
    for sub in sorted(e for e in root.iterdir() if e.is_dir())[:50]:  # a few folders say enough
        try:
            images = any(f.suffix.lower() in IMG_EXTENSIONS for f in sub.iterdir() if f.is_file())
        except OSError:  # a folder of someone else's (/tmp's systemd-private-*): not the user's images
            continue
        if images:
            raise UserError(f"{root} holds folders of images ({sub.name}/...), not {title}'s files: train on them with "
                            f"--dataset imagefolder --data-dir {root}, or give {title}'s folder")
