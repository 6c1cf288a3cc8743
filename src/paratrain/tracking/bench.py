"""A bench in the experiment trackers (--logger mlflow, wandb, csv): sent after every measurement, so no tracker
takes time from one. One parent run for the bench (its results.json, report.md and plots as artifacts) and a
child run per configuration: its first repeat's run (options, figures, summary), the row's figures (the mean and
spread of examples/s and epoch times, the speed-up), and its state (failed, with the reason)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..core.run_paths import RunPaths
from . import trackers

TRACKING = ("logger", "mlflow_uri", "experiment")  # the bench's own, never its runs': they log no tracker live


def _say(line: str) -> None:
    print(line.replace("paratrain: logging to", "bench: logging to"), file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    """Where a row's tracker run is: not a line each (the parent's says where they all go)."""


def _row_figures(row: dict[str, Any]) -> dict[str, float]:
    """A configuration's row as figures: each statistic's mean (and std), the speed-up and efficiency."""
    found: dict[str, float] = {}
    for key, value in row.items():
        if isinstance(value, dict) and value.get("mean") is not None:
            found[key] = value["mean"]
            if value.get("std") is not None:
                found[f"{key}_std"] = value["std"]
    return {**found, **trackers.figures({k: row[k] for k in ("speedup", "efficiency") if k in row})}


def send(report: dict[str, Any], out: Path, tracking: dict[str, Any], workload: dict[str, Any]) -> None:
    """The bench's parent run and a child run per row of `report` (results.json's)."""
    names = trackers.named(tracking.get("logger"))
    if not names:
        return
    uri = tracking.get("mlflow_uri")
    RunPaths(out).trackers.unlink(missing_ok=True)  # a bench run again measures afresh: a new parent run
    ident = trackers.identity(out, {**workload, **tracking, "repeats": report.get("repeats")}, {"kind": "bench"})
    ident.group = ident.name
    parent = trackers.Trackers(out, names, ident, _say, uri)
    parent_id = parent.kept.get("mlflow", {}).get("run_id")
    for row in report["results"]:
        folder = out / "runs" / f"{row['name'].replace(':', '-')}-r0"
        measured = row["status"] == "ok" and RunPaths(folder).config.is_file()
        tags = {"kind": "configuration", "configuration": row["name"], "state": row["status"],
                **({"error": str(row.get("error"))[:500]} if row.get("error") else {}),
                **({"same_as": row["same_as"]} if row.get("same_as") else {})}
        trackers.send(folder, names, _quiet, warn=_say, uri=uri, tags=tags, parent=parent_id, group=ident.name,
                      experiment=ident.experiment, options=None if measured else {**workload, "out": str(folder)},
                      state="FINISHED" if row["status"] == "ok" else "FAILED", final=_row_figures(row),
                      name=row["name"])
    files = [out / "results.json", out / "report.md", *sorted(out.glob("*.png"))]
    parent.finish(None, "FINISHED", [f for f in files if f.is_file()])
