"""The files beside a run's metrics.jsonl that its trackers read and write: metrics.jsonl's records, the CSV
table of them (--logger csv), and trackers.json (the tracker runs a run logs into)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ..core.outputs import write_atomic
from ..core.run_paths import RunPaths


def records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (a torn last line left out)."""
    try:
        lines = RunPaths(run_dir).metrics.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in found if isinstance(r, dict)]


def write_csv(run_dir: Path) -> None:
    rows = records(run_dir)
    if not rows:  # a folder with no metrics.jsonl (a search's, a bench's): no table
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: (json.dumps(v) if isinstance(v, list | dict) else v) for k, v in row.items()} for row in rows)
    write_atomic(RunPaths(run_dir).metrics_csv, text.getvalue())


def kept(run_dir: Path) -> dict[str, Any]:
    """trackers.json: each tracker's run (`sent`: the records it took before it failed; `ended`: how it ended)."""
    return read_json(RunPaths(run_dir).trackers) or {}


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object's file (None: missing, torn, or not an object)."""
    try:
        found = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return found if isinstance(found, dict) else None
