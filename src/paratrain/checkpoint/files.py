"""Checkpoints: written atomically, read safely (weights_only), checked against the model in use."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..core.errors import Unreadable, UserError
from ..core.outputs import writing
from ..core.run_paths import RunPaths
from . import dcp
from .run_folder import step_checkpoints, weights_only

REQUIRED = ("model", "optimizer", "step", "epoch", "config")
WEIGHTS_KEPT = "weights"  # a checkpoint's "kept": only its weights were kept (search/keep.py), it cannot carry a run on


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`: a kill at any
    moment leaves either the old complete file or the new complete file, never half of one. A write that
    fails (a full disk) removes its temporary file and raises WriteFailed naming `path`."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:  # a file object: torch.save's error then carries the OSError
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def newest_loadable(folder: str | Path, whole: bool = True, say: bool = True) -> dict[str, Any] | None:
    """The checkpoint of the highest step in `folder` (a run's checkpoints/) that loads; None where it holds
    none. One line on stderr names the newer ones that did not load, and why (where `say`: one worker of a group
    says it); a UserError when none loads.

    The step checkpoints kept (--keep-checkpoints, 2 by default) are what a damaged newest one falls back on: step
    folders (checkpoint/dcp.py, every layout's), and an earlier release's step files, whose last.pt is a hard link
    to the newest step file (so damage to one is damage to both)."""
    folder = Path(folder)
    skipped: list[tuple[Path, str]] = []
    for path in _newest_first(folder):
        try:
            state = load(path, whole)
        except UserError as e:  # (the reason alone, where the error says it apart from its advice)
            skipped.append((path, e.reason if isinstance(e, Unreadable) else str(e)))
            continue
        if skipped and say:
            names = ", ".join(p.name for p, _ in skipped)
            print(f"paratrain: skipped {names} in {folder} ({skipped[0][1]}); using {path.name}, step "
                  f"{state['step']}", file=sys.stderr, flush=True)
        return state
    if skipped:
        more = f" (and {len(skipped) - 1} other checkpoint(s) there)" if len(skipped) > 1 else ""
        raise UserError(f"no checkpoint in {folder} loads: {skipped[0][1]}{more}; start a new run, or restore "
                        "its checkpoints from a copy")
    return None


def _newest_first(folder: Path) -> list[Path]:
    """The step files by step, newest first, then last.pt where it is another file (a copy, on a filesystem
    without hard links); each file once."""
    seen: set[tuple[int, int]] = set()
    found = []
    for path in [*(p for _, p in reversed(step_checkpoints(folder))), folder / "last.pt"]:
        try:
            st = path.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            found.append(path)
    return found


def load(path: str | Path, whole: bool = True) -> dict[str, Any]:
    """Load a paratrain checkpoint with weights_only=True: a pickle that carries code is refused. A run
    directory: the newest of its checkpoints that loads (newest_loadable). A sharded checkpoint's folder
    (checkpoint/dcp.py): its meta.pt, with "sharded" naming the folder, and (`whole`) its whole weights and EMA read
    in this process; the workers that carry a run on read their own parts instead (whole=False)."""
    path = Path(path)
    if path.is_dir() and not dcp.is_sharded(path) and not path.name.startswith("step-"):  # a run directory
        state = newest_loadable(RunPaths(path).checkpoints, whole)
        if state is not None:
            return state
        raise UserError(f"{path} holds no checkpoint (no step checkpoint in {RunPaths(path).checkpoints}); pass a "
                        "run directory that has one, a step checkpoint or a .pt file")
    is_sharded = dcp.is_sharded(path)
    if path.is_dir() and not is_sharded:
        raise Unreadable(f"checkpoint {path} is not a whole sharded checkpoint (its .metadata or meta.pt is "
                         "missing)")
    if not path.is_file() and not is_sharded:
        raise UserError(f"checkpoint {path} does not exist; pass a run directory, a step checkpoint "
                        "or a .pt file that exists")
    try:
        with open(path / dcp.META if is_sharded else path, "rb") as f:  # opened once: checked and loaded alike
            state = _load_open(f, path)
    except OSError as e:  # removed while being read (a pruning, a search tidying its trials)
        raise Unreadable(f"checkpoint {path} is unreadable ({e.strerror or e})") from None
    needed = [k for k in REQUIRED if not (is_sharded and k in dcp.TENSORS)]
    if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} holds weights alone (a state dict, as paratrain export writes it), without the "
                        "run's options and data: pass the run directory it came from, or load the weights into "
                        "your network in Python (net.load_state_dict(torch.load(...)))")
    if not isinstance(state, dict) or any(k not in state for k in needed):
        raise UserError(f"checkpoint {path} is not a paratrain checkpoint (it lacks "
                        f"{', '.join(k for k in needed if not isinstance(state, dict) or k not in state)})")
    if is_sharded:
        dcp.check_version(state, path)
        metadata = dcp.check_complete(path)
        state["sharded"] = str(path)  # in memory: the folder its strategy reads its shards from
        state["flat_optimizer"] = dcp.flat_optimizer(metadata)  # in memory: how to read its optimizer state
        if whole:
            state.update(dcp.whole(path, metadata=metadata))
    return state


def _load_open(f: Any, path: Path) -> Any:
    if not zipfile.is_zipfile(f):  # torch.save writes a zip archive; anything else is damaged or foreign
        raise Unreadable(f"checkpoint {path} is unreadable: it is not a torch checkpoint (damaged, or another "
                         "kind of file)")
    f.seek(0)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} was refused: it holds more than weights ({first[:160]}); "
                        "only load checkpoints you trust, written by paratrain") from None
    except Exception as e:  # torch.load on a damaged file fails in many ways; all mean "unreadable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unreadable(f"checkpoint {path} is unreadable ({first[:160]}); it is truncated or not a "
                         "torch checkpoint") from None


def agree(ctx: Any, local: dict[str, Any] | None, error: str | None,
          restarts: int) -> tuple[dict[str, Any] | None, int]:
    """The group's one checkpoint to carry on from: the newest any worker found, and the most restarts any of
    them counts (collective: every worker calls it, also one with an `error`).

    Each worker offers the step of the checkpoint it read from its own disk. Where every worker holds the whole
    model (ddp), rank 0 writes the checkpoints alone, on its node only, and after a torchrun restart rank 0 may be
    on another node; so a worker that found an older one, or none, receives the newest from a worker that holds
    it, point to point, its tensors whole. (The sharded layouts' workers each write their part, into a folder that
    every node mounts: dcp.py.) A worker that found
    the same step keeps what it read: on one machine (one disk) nothing is sent. torchrun counts restarts
    per node (a node whose workers were healthy restarts them without counting), so the restart count is the
    group's largest. A worker's `error` (an unreadable checkpoint, one of another model) stops every worker
    with that message. The checkpoint is None where nobody has one."""
    import torch.distributed as dist

    if not ctx.distributed:
        if error:
            raise UserError(error)
        return local, restarts
    offers: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(offers, (-1 if local is None else int(local["step"]), restarts, error))
    for rank, (_, _, problem) in enumerate(offers):
        if problem:
            raise UserError(f"rank {rank}: {problem}")
    newest = max(step for step, _, _ in offers)
    restarts = max(r for _, r, _ in offers)
    if newest < 0:
        return None, restarts
    holder = min(r for r in range(ctx.world_size) if offers[r][0] == newest)
    lacking = [r for r in range(ctx.world_size) if offers[r][0] != newest]
    if ctx.rank == holder:
        sent = local
        if lacking and "sharded" in local and "model" not in local:  # a step folder that only rank 0 wrote
            # (every worker holds the whole model: ddp, Strategy.replicated), on its node's disk: sent whole
            sent = {**local, **dcp.whole(local["sharded"], dcp.TENSORS, values=True)}
        for rank in lacking:
            dist.send_object_list([sent], dst=rank)
    elif ctx.rank in lacking:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=holder)
        local = box[0]
    return local, restarts


MODEL_OPTIONS = ("width", "depth", "activation", "filters", "kernel")  # the options that shape a registry model


def load_weights(model: torch.nn.Module, state: dict[str, Any], path: str | Path,
                 options: dict[str, Any] | None = None) -> None:
    """Load the checkpoint's weights into `model`, or say why they do not fit: another network of the user's,
    or the model options `options` (the run's configuration now) changed since the checkpoint."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise not_fitting(state, path, options, " ".join(str(e).split())[:200]) from None


def options_changed(saved: dict[str, Any], options: dict[str, Any], path: str | Path) -> str | None:
    """Why the run whose configuration was `saved` cannot be carried on with the model options `options` (those
    that shape a registry model changed: its weights would not fit); None where none changed."""
    changed = [k for k in MODEL_OPTIONS if k in saved and options.get(k) != saved[k]]
    if not changed:
        return None
    built = ", ".join(f"{k} {saved[k]}" for k in changed)
    return (f"checkpoint {path} holds a {saved.get('model')} built with {built}; resume it without changing "
            + ", ".join(f"--{k}" for k in changed))


def not_fitting(state: dict[str, Any], path: str | Path, options: dict[str, Any] | None, detail: str) -> UserError:
    """Why the checkpoint `state`'s weights do not fit the network of the run now (`detail`: the first misfit), in
    the words of what to do: pass the factory it was trained with, or leave the model options it was built with."""
    saved = state["config"] if isinstance(state.get("config"), dict) else {}
    if saved.get("model") == "custom":
        ran = (state.get("parts") or {}).get("model")
        return UserError(f"checkpoint {path} holds weights that do not fit the network your factory builds "
                         f"({detail[:120]}); pass the factory the run was trained with" + (f", {ran}" if ran else ""))
    if options is not None and (why := options_changed(saved, options, path)):
        return UserError(why)
    return UserError(f"checkpoint {path} holds weights of another shape than this {saved.get('model', '?')} "
                     f"({detail})")


def check_resumable(state: dict[str, Any], run: str | Path) -> None:
    """A checkpoint that kept only its weights cannot carry a run on exactly: say so, and what would (the
    launcher has said so already from the folder's mark, run_folder.weights_only; this is for a mark gone)."""
    if state.get("kept") == WEIGHTS_KEPT:
        raise UserError(weights_only(run) or f"{run} kept only its weights, so it cannot be carried on")
