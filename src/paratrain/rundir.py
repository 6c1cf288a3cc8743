"""Output folders: checked before any work, so that a bad --out costs one line and nothing else."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UserError


def writable_dir(path: str | Path, flag: str = "--out") -> Path:
    """Create the output folder (and its parents) and check that a file can be written in it, before any
    data is loaded or a process started: a bad --out is one line, not a traceback after the work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".paratrain-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be created or written ({e.strerror or e}); pass a folder "
                        "you can write to") from None
    return path
