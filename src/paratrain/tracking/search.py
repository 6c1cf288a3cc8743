"""A search in the experiment trackers (--logger mlflow, wandb): one parent run for the search (its folder's
trackers.json keeps it; the study keeps its id for every worker, on any machine) and a child run per trial, sent
when the trial ends with its parameters, its objective and its state (finished, pruned, failed with the reason).
The trials themselves log to no tracker while they train: their records go once, afterwards."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..core.run_paths import RunPaths
from . import trackers

PARENT = "tracker_parent"  # the study's user attribute: {"mlflow": run id, "group": the search's name}


def _say(line: str) -> None:
    print(line.replace("paratrain: logging to", "search: logging to"), file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    """Where a trial's tracker run is: not a line each (the parent's says where they all go)."""


def open_parent(study: Any, base: dict[str, Any], out: Path, settings: dict[str, Any]) -> None:
    """The search's own tracker run (the same one when the search is run again), its id in the study."""
    chosen = trackers.named(base.get("logger"))
    if not chosen:
        return
    ident = trackers.identity(out, {**base, **settings}, {"kind": "search"})
    ident.group = ident.name
    found = trackers.Trackers(out, chosen, ident, _say, base.get("mlflow_uri"))
    study.set_user_attr(PARENT, {"mlflow": found.kept.get("mlflow", {}).get("run_id"), "group": ident.name,
                                 "experiment": ident.experiment})
    for tracker in found.live:  # MLflow's is left running, for the search's report to end; W&B's holds this
        if tracker.name == "wandb":  # process's one run while it is open: ended now, carried on at the end
            found._guard("wandb", lambda t=tracker: t.finish([], None, "FINISHED"))


def send_trial(study: Any, base: dict[str, Any], trial_dir: Path, number: int, params: dict[str, Any],
               state: str, value: float | None = None, error: str | None = None) -> None:
    """A trial's child run: `state` one of finished, pruned, failed (`error` its reason)."""
    chosen = trackers.named(base.get("logger"))
    parent = study.user_attrs.get(PARENT) or {}
    if not chosen:
        return
    options = None if RunPaths(trial_dir).config.is_file() else {**base, **params}
    tags = {"kind": "trial", "trial": str(number), "state": state, **({"error": error[:500]} if error else {}),
            **{f"param.{k}": str(v) for k, v in params.items()}}
    final = {"objective": value} if value is not None and value == value else None  # NaN: no objective
    trackers.send(trial_dir, chosen, _quiet, warn=_say, uri=base.get("mlflow_uri"), tags=tags,
                  parent=parent.get("mlflow"), group=parent.get("group"), experiment=parent.get("experiment"),
                  options=options, final=final,
                  state={"finished": "FINISHED", "pruned": "KILLED"}.get(state, "FAILED"))


def close_parent(base: dict[str, Any], out: Path, best: float | None, files: list[Path]) -> None:
    """The search's run ended: its best objective and its report's files."""
    chosen = trackers.named(base.get("logger"))
    if not chosen:
        return
    ident = trackers.identity(out, base)
    found = trackers.Trackers(out, chosen, ident, _quiet, base.get("mlflow_uri"), warn=_say)
    found.finish(None, "FINISHED", [f for f in files if f.is_file()],
                 {"best_objective": best} if best is not None else None)
