"""Named training configurations: the classic tutorials' setups, one YAML file each.

The first line of each file is a comment that `paratrain recipes` shows.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from ...core.errors import UserError
from .. import load_yaml


def _files() -> dict[str, Any]:
    return {f.name[:-5]: f for f in resources.files(__package__).iterdir() if f.name.endswith(".yaml")}


def available() -> dict[str, str]:
    """name -> the one-line description of every recipe."""
    return {name: f.read_text().splitlines()[0].lstrip("# ").strip() for name, f in sorted(_files().items())}


def load(name: str) -> dict[str, Any]:
    files = _files()
    if name not in files:
        raise UserError(f"unknown recipe '{name}'; choose one of: {', '.join(sorted(files))} (`paratrain recipes`)")
    with resources.as_file(files[name]) as path:
        return load_yaml(path)
