"""Output folders and files written safely: an output folder checked before any work (so that a bad --out costs one
line and nothing else), and files written whole or not at all, a failed write named by the file the user knows."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import UserError, WriteFailed, os_error_in
from .run_paths import RunPaths


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """Make sure the output folder can be created and written, before any data is loaded or process started:
    a bad --out is one line, not a traceback after the work. It is tried for real (the folder and a file
    in it are made) and then put back as it was, so a later bad input still leaves nothing behind."""
    path = Path(path)
    try:
        exists = path.exists()
    except OSError as e:  # e.g. a name too long for the file system
        raise UserError(f"{flag} {str(path)[:200]} cannot be used ({e.strerror or e}); pass another folder") from None
    if exists and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder (it is created if missing)")
    if exists:
        check_owned(path, flag)
    missing = [p for p in [path, *path.parents] if not p.exists()]
    try:
        for tries in range(100):  # another start's check may remove the folder it made too, between these two
            path.mkdir(parents=True, exist_ok=True)
            try:
                fd, probe = tempfile.mkstemp(dir=path, prefix=".paratrain-write-check-")
                break
            except FileNotFoundError:
                if tries == 99:
                    raise
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path} cannot be created or written ({e.strerror or e}); pass a folder "
                        "you can write to") from None
    finally:
        remove_made(missing)
    return path


def remove_made(folders: list[Path]) -> None:
    """Remove `folders`, which this process made (deepest first: a check of --out, a start that failed), where
    each is empty and no run holds it. A run started at the same moment into the same folder may have found it
    made and locked it as its own
    (checkpoint/run_folder.held): removing it then would leave that run's lock on a deleted folder, and a
    second run could take the folder made again. So each is locked while it is removed (the run that comes to
    it then makes it again), and one that a run holds is left with its parents."""
    for folder in folders:
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError:
            continue  # gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            folder.rmdir()
        except OSError:  # held by a run, or not empty: it stays, and so do the folders it is in
            return
        finally:
            os.close(fd)


def check_owned(path: Path, flag: str = "--out") -> None:
    """An existing output folder must be the user's own, and closed to other users: otherwise someone else
    could have planted files or links in it that the run would then write through."""
    info = path.stat()
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise UserError(f"{flag} {path} belongs to another user (uid {info.st_uid}); pass a folder of your own")
    if info.st_mode & stat.S_IWOTH:
        raise UserError(f"{flag} {path} can be written by every user (mode {stat.filemode(info.st_mode)}); pass a "
                        f"folder only you can write, or run chmod o-w {path}")
    # What the run writes into rather than replaces must be what it seems: its folders, its appended log.
    for inside, folder in RunPaths(path).written_into():
        name = inside.name
        if inside.is_symlink() or (inside.exists() and inside.is_dir() != folder):
            what = "a link" if inside.is_symlink() else ("a file" if folder else "a folder")
            raise UserError(f"{flag} {path} holds {what} named {name}, where the run keeps its "
                            f"{'folder' if folder else 'log'}; remove it or pass another folder")


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Around a write into the run directory: an OSError (or a library's error raised over one) becomes
    WriteFailed, naming `path`, the file the user knows, not the temporary file it was being written as."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:
        cause = os_error_in(e)
        if cause is None:
            raise
        raise WriteFailed(path, cause) from None


def write_atomic(path: Path, text: str) -> None:
    """Write a file of the run directory as a new file renamed over the old name: a link planted there is
    replaced, never followed, and a reader never sees half a file (a failed write leaves the old one)."""
    with writing(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the run's record from the user's group
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
