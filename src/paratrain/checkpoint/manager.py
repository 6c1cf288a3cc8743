"""The one owner of a run's checkpoints (as torchtitan's CheckpointManager owns its step-N folders).

    RunCheckpoints(run_dir)   lists checkpoints/ once, on first asked: the steps there, the newest, its form (a
                              step folder, or an earlier release's whole-model file), whether it kept only weights
      .found()                that listing as a `Found`, small and frozen: what the launcher carries in the plan
      .check_form(strategy, reads_whole_files)   the newest checkpoint's form is one the strategy reads
      .newest_loadable()      in a worker: the newest checkpoint that loads (its tensors read by the strategy
                              where it is sharded)
      .save_sharded(...)      a step's checkpoint written as a step folder (every rank its part; checkpoint/dcp.py,
                              the one format of every layout), the older ones pruned
      .wait()                 where the saves are written in the background (--async-checkpoint,
                              `background`): until the last has been written

The launcher asks it once (session.py) and hands the answer to the workers in the plan; each worker reads the
checkpoint it carries on from itself, once (resume.py), since only a worker knows which part it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..core.run_paths import RunPaths
from . import dcp
from . import files as checkpoint_files
from .background import Background
from .run_folder import WEIGHTS_ONLY, step_checkpoints, weights_only


def whole_file_not_read(run_dir: str | Path, strategy: str) -> UserError:
    """Why a run's earlier-release whole-model file is not carried on under `strategy` (one that does not
    `reads_whole_files`): before launch (check_form), or in a worker that fell back to such a file."""
    return UserError(f"the checkpoint in {run_dir} holds one whole-model file of an earlier release, which "
                     f"--strategy {strategy} does not read (it reads step folders); carry it on with ddp, tower or "
                     f"pipeline (without --strategy: the one that wrote it), or start a new run under --strategy "
                     f"{strategy}")


@dataclass(frozen=True)
class Found:
    """What a run folder's checkpoints/ held when it was listed, by name (no checkpoint opened)."""

    newest_step: int | None = None  # None: no checkpoint
    sharded: bool = False  # the newest is a step folder (not an earlier release's whole-model file)
    weights_only: bool = False  # a search trial's kept weights: it cannot carry a run on


class RunCheckpoints:
    """A run folder's checkpoints: listed once, then asked."""

    def __init__(self, run_dir: str | Path, ctx: Any = None, background: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.folder = RunPaths(self.run_dir).checkpoints
        self._found: Found | None = None
        self.ctx = ctx  # a worker's (where it saves)
        self.background = Background(ctx) if background else None  # collective where distributed

    def found(self) -> Found:
        """The listing, made on the first call only."""
        if self._found is None:
            steps = step_checkpoints(self.folder)
            self._found = Found(steps[-1][0] if steps else None, bool(steps) and steps[-1][1].is_dir(),
                                (self.folder / WEIGHTS_ONLY).is_file())
        return self._found

    def why_not_resumable(self) -> str | None:
        """Why this run cannot be carried on, where its checkpoint kept only its weights; else None."""
        return weights_only(self.run_dir) if self.found().weights_only else None

    def check_form(self, strategy: str, reads_whole_files: bool) -> None:
        """The newest checkpoint's form is one `strategy` reads: every strategy reads a step folder (what every
        layout writes); an earlier release's whole-model file only where it `reads_whole_files` (not fsdp and
        hsdp). Refused before config.yaml would say another strategy."""
        found = self.found()
        if found.newest_step is not None and not found.sharded and not reads_whole_files:
            raise whole_file_not_read(self.run_dir, strategy)

    def newest_loadable(self) -> dict[str, Any] | None:
        """The newest checkpoint that loads (None: none there); a sharded one's tensors are left for the strategy
        to read, each rank its own part."""
        # a damaged newest checkpoint is skipped by every worker, and said by one
        return checkpoint_files.newest_loadable(self.folder, whole=False, say=self.ctx is None or self.ctx.is_main)

    def save_sharded(self, ctx: Any, tensors: dict[str, Any], meta: Callable[[], dict[str, Any]], step: int,
                     keep: int) -> None:
        """Write step `step`'s checkpoint as a sharded folder, every rank its part of `tensors` and rank 0
        `meta()` (collective), and keep the newest `keep`."""
        self._found = None
        dcp.save_step(ctx, tensors, meta, self.folder, step, keep, self.background)

    def wait(self) -> None:
        """Until every checkpoint begun is written, on every worker (collective where the saves are written in
        the background; nothing to wait for where they are not)."""
        if self.background is not None:
            self.background.wait()
            self.ctx.barrier()  # no worker leaves before rank 0 has made the last checkpoint whole
