"""Sharded checkpoints: a folder per step, `step-NNNNNNNN/`, written by torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the weights, the optimizer state and the EMA (no rank gathers the
whole model), and DCP's metadata says where each piece of every tensor lies, so a later run reads them
into whatever shards it holds: a run saved on 2 workers carries on with 1 or with 4. Rank 0 adds
`meta.pt` (the step, scheduler, configuration: what checkpoint.load checks, the same as a whole-model
file's) and makes the folder visible in one rename, so a kill leaves the last folder whole or absent.
The shards of every rank go to one folder: several nodes need a shared file system (as DCP itself does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import UserError
from .rundir import step_checkpoints, writing

META = "meta.pt"  # rank 0's part of a sharded checkpoint: everything but the tensors
FORMAT = "dcp"  # a checkpoint's "sharded": how its tensors are stored (torch.distributed.checkpoint)
TENSORS = ("model", "optimizer", "ema_model")  # what a sharded checkpoint's DCP part holds


def is_sharded(path: Path) -> bool:
    """Whether `path` is a sharded checkpoint's folder (DCP's metadata and rank 0's meta.pt in it)."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns, in a single process, that it assumes a single process: that is what we meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield


def save_step(ctx: Any, tensors: dict[str, Any], meta: Callable[[], dict[str, Any]], folder: str | Path,
              step: int, keep: int) -> Path:
    """Write the step's sharded checkpoint (collective: every rank of the group `ctx` calls it, with its own
    shards in `tensors`); keep the `keep` newest step checkpoints. `meta()` is built on rank 0 only."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    final, building = folder / f"step-{step:08d}", folder / f".step-{step:08d}.tmp"
    if ctx.is_main:
        with writing(final):
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir(parents=True)
    ctx.barrier()  # the folder exists before any rank writes into it
    with writing(final), _quiet():
        written = dcp.save(tensors, checkpoint_id=building, no_dist=not ctx.distributed)
    _check_shared(ctx, building, written)
    if ctx.is_main:
        with writing(final):
            _publish(building, final, {**meta(), "sharded": FORMAT, "torch": str(torch.__version__)})
            for _, old in step_checkpoints(folder)[:-keep]:
                _remove(old)
    ctx.barrier()  # no rank goes on (or leaves on a signal) before the checkpoint is whole
    return final


def _check_shared(ctx: Any, building: Path, written: Any) -> None:
    """Every rank's shards must be in rank 0's folder: on several nodes without a shared file system they land
    on each node's own disk, and the checkpoint could never be read. Agreed by all (collective)."""
    missing = torch.zeros(1, device=ctx.device)
    if ctx.is_main:
        files = {item.relative_path for item in (written.storage_data or {}).values()}
        missing.fill_(sum(not (building / name).is_file() for name in files))
    ctx.all_reduce_sum(missing)
    if missing.item():
        raise UserError(f"the shards of a sharded checkpoint did not all reach {building.parent}: the nodes do not "
                        "share it; pass an --out on a file system every node mounts (fsdp and hsdp write each "
                        "rank's shards there)")


def _publish(building: Path, final: Path, meta: dict[str, Any]) -> None:
    """Add rank 0's meta.pt, make every file durable, then show the folder under its step's name at once."""
    with open(building / META, "wb") as f:
        torch.save(meta, f)
    for path in building.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if final.exists():  # the same step saved again (a finished run's last checkpoint): set the old one aside
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(building, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(building, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_version(meta: dict[str, Any], path: Path) -> None:
    """DCP reads checkpoints of earlier torch releases; one written by a later release is refused."""
    saved = str(meta.get("torch", ""))
    if _release(saved) > _release(torch.__version__):
        raise UserError(f"checkpoint {path} was written by torch {saved}, newer than this torch "
                        f"{torch.__version__}; install torch>={saved.split('+')[0]} to read it")


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def read(path: str | Path, into: dict[str, Any], distributed: bool) -> None:
    """Load the checkpoint's pieces that `into` asks for into its tensors, in place, whatever shards they are
    (collective where `distributed`: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _quiet():
        try:
            dcp.load(into, checkpoint_id=Path(path), no_dist=not distributed)
        except (Exception, CheckpointException) as e:  # a BaseException: a rank's failure, wrapped
            cause = next(iter(e.failures.values()), e) if isinstance(e, CheckpointException) else e
            cause = getattr(cause, "exc", cause)  # DCP's record of a rank's exception holds it as .exc
            first = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
            raise UserError(f"checkpoint {path} could not be read into this run's shards ({first}); it is "
                            "damaged, or of another network") from None


def whole(path: str | Path, parts: tuple[str, ...] = ("model", "ema_model")) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's whole tensors of `parts` on the CPU, in one process (no group): {"model": {name:
    tensor}, and "ema_model" where it has one}, for evaluation, export and load_model. The optimizer's are
    named by their place in its state dict ("state.NAME.exp_avg")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    into: dict[str, dict[str, torch.Tensor]] = {}
    for key, item in metadata.state_dict_metadata.items():
        top, _, name = key.partition(".")
        if top in parts and isinstance(item, TensorStorageMetadata):
            into.setdefault(top, {})[name] = torch.empty(item.size, dtype=item.properties.dtype)
    read(path, into, distributed=False)
    return into
