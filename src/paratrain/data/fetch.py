"""Downloads that fail leave nothing behind: bad input (a wrong --data-dir, no network) writes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
