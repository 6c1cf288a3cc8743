"""What a finished trial keeps on disk (--keep-trial-checkpoints): a trial's checkpoints hold its optimizer
state (Adam's doubles the weights) and several steps, so a search of a large network would keep gigabytes of
checkpoints no one carries on. Only the best trial can be worth carrying on; the others are worth scoring
and loading (weights), or nothing.

    all    every trial keeps its checkpoints, each one can be carried on (`paratrain train --resume TRIAL`)
    best   the best trial keeps them; every other finished trial keeps its last weights only (default)
    none   no finished trial keeps a checkpoint (trials.csv, their config.yaml and metrics stay)

A trial still running is never touched. One left running by a stopped search is queued again under a new
number and trained afresh by the search run again; its old folder is then a finished (failed) trial's. Each
pool process tidies after each trial it finishes, so the best of the moment
keeps its checkpoints and the trial it overtook loses them; two processes tidying at once write the same
files atomically.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ..checkpoint import dcp
from ..checkpoint import files as checkpoint
from ..checkpoint.run_folder import WEIGHTS_ONLY, step_checkpoints
from ..core.errors import UserError
from ..core.run_paths import RunPaths
from .objective import of_study

POLICIES = ("none", "best", "all")


def tidy(study: Any, out: str | Path, policy: str) -> None:
    """Apply `policy` to every finished trial's folder under OUT/trials."""
    from optuna.trial import TrialState

    if policy == "all":
        return
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("reused") is None]
    best = of_study(study).best(done, lambda t: t.value).number if done and policy == "best" else None
    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    for t in trials:
        folder = RunPaths(Path(out) / "trials" / f"{t.number:04d}").checkpoints
        if t.state not in finished or t.number == best or not folder.is_dir():
            continue
        if policy == "none":
            shutil.rmtree(folder, ignore_errors=True)
        else:
            weights_only(folder)


def weights_only(folder: Path) -> None:
    """Replace a run's checkpoints by its newest one without what only carrying it on needs (optimizer,
    scheduler and scaler state, older steps). Done once: the step files go last, so a tidy that was cut
    off is done again."""
    steps = step_checkpoints(folder)
    if not steps:
        return  # already done, or no checkpoint was written
    try:
        state = checkpoint.newest_loadable(folder)
    except UserError:  # none loads: nothing worth keeping
        state = None
    if state is not None and state.get("kept") != checkpoint.WEIGHTS_KEPT:
        # a sharded checkpoint (read whole here) becomes one file like any other: its folder goes with the rest
        dropped = ("optimizer", "scheduler", "scaler", "sharded", "flat_optimizer")  # the last two: in memory only
        kept = {k: v for k, v in state.items() if k not in dropped}
        checkpoint.save({**kept, "optimizer": None, "kept": checkpoint.WEIGHTS_KEPT}, folder / "last.pt")
    (folder / WEIGHTS_ONLY).write_text("last.pt holds this trial's weights only: --resume refuses it "
                                       "(paratrain search --keep-trial-checkpoints)\n")
    for _, path in steps:
        dcp.remove(path)  # a step folder (or an earlier release's file)
