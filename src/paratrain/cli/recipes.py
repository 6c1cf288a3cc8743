"""`paratrain recipes`: the named starting points of `paratrain train --recipe NAME`."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("recipes", help="list the recipes that `paratrain train --recipe NAME` takes").set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..config import recipes

    for name, line in recipes.available().items():
        print(f"{name:<18} {line}")
    return 0
