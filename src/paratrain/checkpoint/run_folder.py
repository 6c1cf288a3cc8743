"""The run folder: held (locked) for the run's whole life, checked before a fresh start, cleared by --overwrite,
and the listing of its checkpoints by step (the files themselves: checkpoint/files.py and dcp.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import UserError
from ..core.outputs import remove_made
from ..core.run_paths import RunPaths

# What a run writes into its folder; --overwrite removes these and nothing else.
WEIGHTS_ONLY = "weights-only.txt"  # in checkpoints/: the checkpoint there kept only its weights (search/keep.py)


def weights_only(run: str | Path) -> str | None:
    """Why the run in `run` cannot be carried on, where its checkpoint kept only its weights; else None."""
    if not (RunPaths(run).checkpoints / WEIGHTS_ONLY).is_file():
        return None
    return (f"{run} kept only its weights (a search trial that was not the best, under --keep-trial-checkpoints "
            f"best), so it cannot be carried on: evaluate or load it, or train it again with paratrain train "
            f"--config {RunPaths(run).config} --out NEW (a search with --keep-trial-checkpoints all keeps "
            "every trial resumable)")


def step_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in a run's checkpoints folder (`step-NNNNNNNN/` folders, every layout's; an earlier
    release's `step-NNNNNNNN.pt` files), by step, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(p.name[5:].removesuffix(".pt")), p) for p in folder.glob("step-*")
             if p.name[5:].removesuffix(".pt").isdigit() and (p.suffix == ".pt") != p.is_dir()]
    return sorted(found, key=lambda found: found[0])


def newest_step(run: Path) -> int | None:
    """The step of the newest checkpoint in the run folder `run`, by its file's name (none is opened); None
    where it has none."""
    steps = step_checkpoints(RunPaths(run).checkpoints)
    return steps[-1][0] if steps else None


def held_run(path: Path) -> str | None:
    """What run `path` holds, in words; None when it holds nothing of value: no summary, checkpoint, logged
    step or event file (a run that stopped before its first step leaves only config.yaml and parts.yaml)."""
    def has_files(folder: Path) -> bool:
        return folder.is_dir() and not folder.is_symlink() and any(folder.iterdir())

    paths = RunPaths(path)
    metrics = paths.metrics
    if not (paths.summary.exists() or has_files(paths.checkpoints) or has_files(paths.tensorboard)
            or (metrics.is_file() and metrics.stat().st_size > 0) or metrics.is_symlink()):
        return None
    step = newest_step(path)
    done = "a finished" if paths.summary.exists() else "an unfinished"
    return f"{done} run" + (f", checkpoints up to step {step}" if step is not None else "")


def check_fresh(path: str | Path, overwrite: bool) -> None:
    """A new run never lands on top of another: its config and summary would be replaced and the old run's
    step checkpoints left beside the new ones."""
    what = held_run(Path(path))
    if what is not None and not overwrite:
        resumable = newest_step(Path(path)) is not None and not weights_only(path)
        how = f"carry it on with --resume {path}, pass a new --out," if resumable else \
            "it has no checkpoint to carry on from: pass a new --out"
        raise UserError(f"--out {path} holds {what}; {how} or add --overwrite to clear it first")  # fit: in fields


def clear_run(path: Path) -> None:
    """--overwrite: remove the files of the run in `path` (only those a run writes)."""
    import shutil

    for inside in RunPaths(path).written():
        if inside.is_dir() and not inside.is_symlink():
            shutil.rmtree(inside)
        elif inside.exists() or inside.is_symlink():
            inside.unlink()


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold the run folder `path` for the whole life of a run: an exclusive flock on the folder itself, taken
    before any file of the run is read or written and let go when the run ends (the kernel lets go when this
    process ends, however it ends). A second command on the same folder is refused in one line that names
    the process holding it, and touches nothing. The folder is made if missing, and removed again (with the
    parents made for it) if this start fails and leaves it empty (not when refused: see _locked)."""
    made = [p for p in [path, *path.parents] if not p.exists()]
    fd = _locked(path, made)
    try:
        yield
    except BaseException:
        os.close(fd)  # let go first: a folder is removed only while no other start holds it (remove_made)
        remove_made(made)
        raise
    os.close(fd)


def _locked(path: Path, made: list[Path]) -> int:
    """The folder `path` made if missing, opened and locked: its descriptor. Another start may remove the folder
    between this one's making, opening and locking it (a start that made it too and puts it back, holding it
    while it does: core/outputs.remove_made): then this start's lock would be on a deleted folder that the next
    start cannot see, so the folder is made and locked again until the lock is on the folder at `path`."""
    for _ in range(100):
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed between the two: made again
        except OSError as e:
            raise UserError(f"--out {path} cannot be created or opened ({e.strerror or e}); pass a folder you can "
                            "write to") from None
        try:
            _lock_soon(fd)
        except OSError as e:
            os.close(fd)
            if isinstance(e, BlockingIOError):
                # Nothing is removed: the folder this start found missing may be the new one of the run that
                # holds it (both started at once), still empty, and removing it would leave that run's lock on a
                # deleted folder.
                raise UserError(f"--out {path} is in use by another run ({holder(path)}); wait for it to end, "
                                "or pass another --out", code=2) from None
            remove_made(made)
            raise
        if _same_folder(fd, path):
            return fd
        os.close(fd)  # locked once it was removed: made and locked again
    raise UserError(f"--out {path} was removed again and again as this run started; pass another --out")


def _lock_soon(fd: int, wait_s: float = 0.3) -> None:
    """Lock `fd`, waiting up to `wait_s` for a holder that lets go at once: another command's check of --out
    holds the folder for an instant while it removes it (core/outputs.remove_made), and must not be taken
    for a run. A run holds it for its whole life: BlockingIOError then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _same_folder(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def holder(path: Path) -> str:
    """The process that holds the flock on `path`, in words (Linux's /proc/locks); "another process" elsewhere."""
    try:
        st = path.stat()
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            pids = [line.split()[4] for line in f if "FLOCK" in line and line.split()[5] == where]
        pid = next(p for p in pids if p.isdigit())
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration, IndexError):
        return "another process"
    return f"process {pid}" + (f": {command[:120]}" if command else "")


def kept_after_failure(run_dir: Path, remedy: str) -> str:
    """After a failed write: the newest checkpoint on disk (each is written whole or not at all), and how to
    go on (`remedy`: what to do about the cause, WriteFailed.remedy)."""
    ckpt_dir = RunPaths(run_dir).checkpoints
    steps = step_checkpoints(ckpt_dir)
    if not steps:
        return f"no checkpoint was kept (none had been written); {remedy} (or pass another --out) and run again"
    step, path = steps[-1]
    return f"the last good checkpoint is {path.name} (step {step}) in {ckpt_dir}; {remedy} and continue with " \
           f"--resume {run_dir}"
