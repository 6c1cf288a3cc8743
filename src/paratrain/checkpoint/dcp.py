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

from ..core.errors import Unreadable, UserError
from ..core.outputs import writing
from .background import Background, staged
from .run_folder import step_checkpoints

META = "meta.pt"  # rank 0's part of a sharded checkpoint: everything but the tensors
FORMAT = "dcp"  # meta.pt's "format": how the tensors are stored (torch.distributed.checkpoint)
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


def state_dict_options(flat: bool = True) -> Any:
    """How the strategies take their state dicts for these checkpoints: the optimizer state flattened to one
    key per parameter name ("state.NAME.exp_avg", "param_groups.NAME.lr"), so that ranks that hold different
    parameters (a pipeline's stages) write parts that never collide, and any strategy's ranks read theirs.
    `flat` False: a checkpoint of fsdp's first release, read as it was written (flat_optimizer)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def flat_optimizer(metadata: Any) -> bool:
    """Whether a checkpoint (its DCP metadata) holds the optimizer state flattened by parameter name; fsdp's
    first checkpoints kept the parameter groups by number (the group's "params" list names its parameters)."""
    return "optimizer.param_groups.0.params" not in metadata.state_dict_metadata


def save_step(ctx: Any, tensors: dict[str, Any], meta: Callable[[], dict[str, Any]], folder: str | Path,
              step: int, keep: int, background: Background | None = None) -> Path:
    """Write the step's sharded checkpoint (collective: every rank of the group `ctx` calls it, with its own
    shards in `tensors`); keep the `keep` newest step checkpoints. `meta()` is built on rank 0 only.
    `background` (--async-checkpoint): the tensors are copied, then written while the caller goes on."""
    import torch.distributed.checkpoint as dcp

    if background is not None:
        background.wait()  # the save before is whole before this one clears the folder's leftovers
    final, building = _prepare(ctx, Path(folder), step)
    if background is not None:
        with _cleared_on_failure(ctx, building), writing(final), _quiet():
            future = dcp.async_save(tensors, checkpoint_id=building, process_group=background.group,
                                    no_dist=not ctx.distributed)  # returns once the tensors are copied
        extras = staged(meta()) if ctx.is_main else None  # this step's, not the state's when the write ends

        def write() -> None:
            with _cleared_on_failure(ctx, building):
                with writing(final):  # a failed write (a full disk) names the checkpoint, as a synchronous one does
                    written = _saved(future.result)
                if ctx.is_main:  # the coordinator's save ends after every rank's shards are written
                    if _missing(building, written):
                        raise _not_shared(building)
                    _publish_and_prune(building, final, extras, step, keep)

        background.start(write)
        return final
    with _cleared_on_failure(ctx, building):
        with writing(final), _quiet():
            written = _saved(lambda: dcp.save(tensors, checkpoint_id=building, no_dist=not ctx.distributed))
        _check_shared(ctx, building, written)
        if ctx.is_main:
            _publish_and_prune(building, final, meta(), step, keep)
    ctx.barrier()  # no rank goes on (or leaves on a signal) before the checkpoint is whole
    return final


@contextlib.contextmanager
def _cleared_on_failure(ctx: Any, building: Path) -> Iterator[None]:
    """A save that fails (a full disk, shards that never reached a shared folder) leaves no half folder: rank 0
    removes the hidden one it was written in (DCP raises on every rank once each has written what it could)."""
    try:
        yield
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(building, ignore_errors=True)
        raise


def _prepare(ctx: Any, folder: Path, step: int) -> tuple[Path, Path]:
    """The step's folder and the hidden one it is written in, made (by rank 0) before any rank writes."""
    final, building = folder / f"step-{step:08d}", folder / f".step-{step:08d}.tmp"
    if ctx.is_main:
        with writing(final):
            for stale in folder.glob(".step-*"):  # a save or a pruning that a kill cut off
                shutil.rmtree(stale, ignore_errors=True)
            folder.mkdir(parents=True, exist_ok=True)
            building.mkdir(mode=0o700)  # its files are written with the umask's mode: the folder keeps them private
    ctx.barrier()  # the folder exists before any rank writes into it
    return final, building


def _saved(save: Callable[[], Any]) -> Any:
    """DCP's save (its metadata); a rank's own failure unwrapped from DCP's CheckpointException (a BaseException
    around a rank's OSError, a full disk)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return save()
    except CheckpointException as e:
        raise _cause(e) from None


def _publish_and_prune(building: Path, final: Path, meta: dict[str, Any], step: int, keep: int) -> None:
    folder = final.parent
    with writing(final):
        _publish(building, final, {**meta, "format": FORMAT, "torch": str(torch.__version__)})
        # a run of an earlier release, which wrote whole-model files (carried on): the same step's file and
        # last.pt would name another checkpoint than the newest
        for other in (folder / f"step-{step:08d}.pt", folder / "last.pt"):
            other.unlink(missing_ok=True)
        for _, old in step_checkpoints(folder)[:-keep]:
            remove(old)


def _cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException: DCP keeps it as .exc of its record where
    distributed, and as the first of an (exception, traceback) pair in one process."""
    failures = getattr(e, "failures", None) or {}
    first = next(iter(failures.values()), e)
    first = first[0] if isinstance(first, tuple) else first
    return getattr(first, "exc", first)


def _check_shared(ctx: Any, building: Path, written: Any) -> None:
    """Every rank's shards must be in rank 0's folder: on several nodes without a shared file system they land
    on each node's own disk, and the checkpoint could never be read. Agreed by all (collective)."""
    missing = torch.zeros(1, device=ctx.device)
    if ctx.is_main:
        missing.fill_(_missing(building, written))
    ctx.all_reduce_sum(missing)
    if missing.item():
        raise _not_shared(building)


def _missing(building: Path, written: Any) -> int:
    """How many of the files DCP's metadata `written` names are not in `building`."""
    files = {item.relative_path for item in (written.storage_data or {}).values()}
    return sum(not (building / name).is_file() for name in files)


def _not_shared(building: Path) -> UserError:
    return UserError(f"the shards of a sharded checkpoint did not all reach {building.parent}: the nodes do not "
                     "share it; pass an --out on a file system every node mounts (the sharded layouts, fsdp, "
                     "hsdp, tp and the pipelines, write each rank's part there)")


def _publish(building: Path, final: Path, meta: dict[str, Any]) -> None:
    """Add rank 0's meta.pt, make every file durable, then show the folder under its step's name at once.
    A folder of the same step already there is a run's earlier pass over it (a resume from an older step, the
    newer one damaged or left behind): it is replaced whole, renamed out of sight first (replacing its meta.pt
    alone kept its damaged shards under the new record)."""
    _write_durably(building / META, meta)
    for path in building.iterdir():
        _fsync(path)
    if final.exists():
        remove(final)
    os.replace(building, final)
    _fsync(final.parent)


def _write_durably(path: Path, value: Any) -> None:
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a step checkpoint: a file, or a sharded folder renamed out of sight first (a kill in the middle
    of its removal leaves no half folder under a step's name)."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    hidden = path.with_name(f".{path.name}.removing")
    try:
        os.replace(path, hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def _metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint folder `path` (where each piece of every tensor lies)."""
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 (a truncated or foreign .metadata fails in many ways)
        raise Unreadable(f"checkpoint {path} is unreadable (its .metadata: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]})") from None


def check_complete(path: Path) -> Any:
    """Every file the metadata names is there and long enough: a folder that lost a rank's shards is refused
    here, before a run commits to it, so the one before is carried on from instead. Returns the metadata."""
    metadata = _metadata(path)
    ends: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in ends.items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            size = -1
        if size < end:
            raise Unreadable(f"checkpoint {path} is incomplete ({name} is missing or cut short)")
    return metadata


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


def _weights_only_planner() -> Any:
    """A load planner that refuses code in the checkpoint's pickles (built here: DCP is imported where a read
    needs it)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP unpickles a checkpoint's items that are not tensors (an optimizer's hyper-parameters) with
        weights_only=False; each is first loaded with weights_only=True, so a pickle that carries code is refused
        before DCP opens it (as checkpoint.load refuses one)."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return WeightsOnlyPlanner()


def read(path: str | Path, into: dict[str, Any], distributed: bool) -> None:
    """Load the checkpoint's pieces that `into` asks for into its tensors, in place, whatever shards they are
    (collective where `distributed`: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _quiet():
        try:
            dcp.load(into, checkpoint_id=Path(path), planner=_weights_only_planner(), no_dist=not distributed)
        except (Exception, CheckpointException) as e:  # a BaseException: a rank's failure, wrapped
            cause = _cause(e)
            first = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
            raise UserError(f"checkpoint {path} could not be read into this run's shards ({first}); it is "
                            "damaged, or of another network") from None


def read_folder(path: str | Path, into: dict[str, Any], distributed: bool) -> None:
    """Load a Hugging Face model folder's safetensors into `into`'s tensors by their names, in place, each rank
    reading the pieces its shards cover (DCP's Hugging Face reader; collective where `distributed`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _quiet():
        try:
            dcp.load(into, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not distributed)
        except Exception as e:  # noqa: BLE001 (a rank's failure, wrapped)
            cause = _cause(e)
            first = " ".join(f"{type(cause).__name__}: {cause}".split())[:200]
            raise UserError(f"{path}: its safetensors could not be read into this run's weights ({first})") from None


def shapes_of(path: str | Path, part: str) -> dict[str, tuple[int, ...]]:
    """{name: whole shape} of the checkpoint's `part` ("model"), from its metadata alone (no tensor read)."""
    return {k.partition(".")[2]: tuple(getattr(item, "size", ())) for k, item in
            _metadata(Path(path)).state_dict_metadata.items() if k.startswith(f"{part}.")}


def tensors_of(path: str | Path, part: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (whole shape, type)} of the tensors of the checkpoint's `part` ("model"), from its metadata alone."""
    return {k.partition(".")[2]: (tuple(item.size), item.properties.dtype) for k, item in
            _metadata(Path(path)).state_dict_metadata.items() if k.startswith(f"{part}.") and hasattr(item, "size")}


def misfit(held: dict[str, Any], shapes: dict[str, Any], whole: bool = False) -> str | None:
    """The first of `shapes` ({name: shape}) that `held` ({name: shape}) lacks or has in another shape, in words;
    `whole` (this worker holds the whole model): also the first that `held` has beyond them (another network's)."""
    extra = [name for name in held if name not in shapes] if whole else []
    if extra:
        return f"{extra[0]} is in the checkpoint and not in this network"
    for name, shape in shapes.items():
        if name not in held:
            return f"{name} is not in the checkpoint"
        if tuple(held[name]) != tuple(shape):
            return f"{name} is {list(held[name])} there and {list(shape)} here"
    return None


def whole(path: str | Path, parts: tuple[str, ...] = ("model", "ema_model"),
          metadata: Any = None, values: bool = False) -> dict[str, dict[str, Any]]:
    """The checkpoint's whole tensors of `parts` on the CPU, in one process (no group): {"model": {name:
    tensor}, and "ema_model" where it has one}, for evaluation, export and load_model. The optimizer's are
    named by their place in its state dict ("state.NAME.exp_avg"); `values`: its other values too (a parameter
    group's "param_groups.NAME.lr"), all a worker needs to carry on from it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = metadata or _metadata(Path(path))  # `metadata`: where the caller has read it already
    into: dict[str, dict[str, Any]] = {}
    for key, item in metadata.state_dict_metadata.items():
        top, _, name = key.partition(".")
        if top in parts and isinstance(item, TensorStorageMetadata):
            into.setdefault(top, {})[name] = torch.empty(item.size, dtype=item.properties.dtype)
        elif top in parts and values:
            into.setdefault(top, {})[name] = None  # read in place of the placeholder
    read(path, into, distributed=False)
    return into


def renamed(state: dict[str, Any], aliases: dict[str, str], back: bool = False) -> dict[str, Any]:
    """`state` with each key of an aliased weight under the whole model's name (`back`: under this worker's
    again): the weight's own key, and a flat optimizer state's (`state.NAME.exp_avg`, `param_groups.NAME.lr`)."""
    if not aliases:
        return state
    pairs = [(c, a) if back else (a, c) for a, c in aliases.items()]

    def one(key: str) -> str:
        for old, new in pairs:
            for head in ("", "state.", "param_groups."):
                if key == head + old or key.startswith(head + old + "."):
                    return head + new + key[len(head + old):]
        return key

    return {one(k): v for k, v in state.items()}
