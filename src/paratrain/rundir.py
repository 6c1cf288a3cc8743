"""Output folders: checked before any work, so that a bad --out costs one line and nothing else."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UserError


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """Make sure the output folder can be created and written, before any data is loaded or process started:
    a bad --out is one line, not a traceback after the work. It is tried for real (the folder and a file
    in it are made) and then put back as it was, so a later bad input still leaves nothing behind."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder (it is created if missing)")
    missing = [p for p in [path, *path.parents] if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".paratrain-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be created or written ({e.strerror or e}); pass a folder "
                        "you can write to") from None
    finally:
        for folder in missing:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                pass
    return path
