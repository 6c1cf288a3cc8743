"""`paratrain search`: many trainings at once, chosen by an Optuna sampler (search/command.py runs it)."""

from __future__ import annotations

import argparse

from .. import config as C
from .parser import add_train_flags


def add(sub: argparse._SubParsersAction) -> None:
    from ..search import command

    p = sub.add_parser("search", help="hyper-parameter search: many trainings at once (Optuna)")
    command.add_flags(p)
    add_train_flags(p, skip=command.NOT_TRAIN_FLAGS)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..core.optional import require

    require("optuna", "paratrain search")  # before anything else is read or written
    from ..search import command

    values = {name: getattr(args, name) for name in C.FIELDS
              if name not in command.NOT_TRAIN_FLAGS and getattr(args, name, None) is not None}
    return command.run(args, values)
