"""argparse as paratrain uses it: one-line errors, and the training flags made from TrainConfig's fields."""

from __future__ import annotations

import argparse
import sys

from .. import config as C
from ..errors import one_line


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"paratrain: error: {one_line(message)}; see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def add_train_flags(p: argparse.ArgumentParser, skip: set[str] | frozenset = frozenset()) -> None:
    """A flag per TrainConfig field (its help, type and choices come from the field), except `skip`."""
    if not skip:
        p.add_argument("--recipe", help="start from a named recipe (see `paratrain recipes`); flags override it")
        p.add_argument("--config", help="YAML file of training options (flags override it)")
    for name, f in C.FIELDS.items():
        if name in skip:
            continue
        flag = f.metadata.get("flag", "--" + name.replace("_", "-"))
        helptext = f"{f.metadata['help']} (default: {f.default})"
        if f.type == "bool":
            p.add_argument(flag, dest=name, action="store_const", const=not f.default, default=None,
                           help=f.metadata["help"])
            continue
        kind = int if "int" in f.type else float if "float" in f.type else str
        choices = f.metadata.get("choices")
        choices = [c for c in choices if c != "custom"] if choices else None  # custom: for paratrain.fit only
        p.add_argument(flag, dest=name, type=kind, default=None, choices=choices,
                       help=helptext, metavar=None if "choices" in f.metadata else name.upper())


def at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Reject a count below 1 in any of the flags `names` (those given)."""
    from ..errors import UserError

    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
