"""argparse as paratrain uses it: one-line errors, and the training flags made from TrainConfig's fields."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import config as C
from ..core.errors import one_line


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump) with a "did you mean" and exit code 2, and no
    abbreviations: `--epoch 1` is not silently `--epochs 1`, and a flag added later never changes what an
    old command line means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = self._did_you_mean(message) if message.startswith("unrecognized arguments:") else ""
        print(f"paratrain: error: {one_line(message)}{hint}; see `{self._command().prog} --help`", file=sys.stderr)
        raise SystemExit(2)

    def _command(self) -> argparse.ArgumentParser:
        """The parser of the command the command line names (`paratrain train`), or this one: argparse
        reports unknown flags at the top, where only the command's parser knows its flags."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = next((t for t in self._argv if t in action.choices), None)
                if command is not None:
                    return action.choices[command]
        return self

    def _did_you_mean(self, message: str) -> str:
        """The closest flag of the command in use to the first unknown one."""
        from ..core.errors import closest

        unknown = next((t.split("=")[0] for t in message.split(":", 1)[1].split() if t.startswith("--")), None)
        if unknown is None:
            return ""
        flags = set(self._option_string_actions) | set(self._command()._option_string_actions)
        close = closest(unknown, sorted(flags))
        return f" (did you mean {close}?)" if close else ""


def add_train_flags(p: argparse.ArgumentParser, skip: set[str] | frozenset = frozenset()) -> None:
    """A flag per TrainConfig field (its help, type and choices come from the field), except `skip`, in a group
    per section of the configuration (config.SECTIONS, as config.yaml and the docs group them)."""
    if not skip:
        p.add_argument("--recipe", help="start from a named recipe (see `paratrain recipes`); flags override it")
        p.add_argument("--config", help="YAML file of training options (flags override it)")
    for section, names in C.SECTIONS.items():
        group = p.add_argument_group(f"{section} options")
        for name in names:
            if name not in skip:
                _add_flag(group, name, C.FIELDS[name])


def _add_flag(p: Any, name: str, f: Any) -> None:
    """The flag of TrainConfig field `name` (`f`, its dataclass field)."""
    flag = f.metadata.get("flag", "--" + name.replace("_", "-"))
    helptext = f.metadata["help"]
    if f.default is not None and "default" not in helptext:
        helptext += f" (default: {f.default})"
    if f.type == "bool":  # a switch: --x turns on what is off, --no-x turns off what is on
        p.add_argument(flag, dest=name, action="store_const", const=not f.default, default=None,
                       help=f.metadata.get("off_help", f.metadata["help"]) if f.default else f.metadata["help"])
        return
    kind = int if "int" in f.type else float if "float" in f.type else str
    choices = f.metadata.get("choices")
    choices = [c for c in choices if c != "custom"] if choices else None  # custom: for paratrain.fit only
    if name == "model":  # a registry name, or the import path of a network of the user's
        kind, choices = _model_type(choices), None
    p.add_argument(flag, dest=name, type=kind, default=None, choices=choices,
                   help=helptext, metavar=None if "choices" in f.metadata else name.upper())


def at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Reject a count below 1 in any of the flags `names` (those given)."""
    from ..core.errors import UserError

    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}")


def _model_type(names: list[str]) -> Any:
    def model(value: str) -> str:
        from ..core.import_path import is_own_network

        if value in names or is_own_network(value):
            return value
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(names)}; or your "
                                         "network's factory, package.module:factory or path/to/file.py:factory)")

    model.__name__ = "model"
    return model
