"""Search spaces: a YAML file of fixed `paratrain train` options and the parameters to search.

    fixed: {model: mlp, dataset: mnist}
    params:
      width: [64, 128, 256]              # a list: these choices
      lr: {low: 1.0e-4, high: 1.0e-2, log: true}   # a range (int when both ends are ints)

Every key is a `paratrain train` option (a TrainConfig field), checked when the file is read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .. import config as C
from ..core.errors import UserError
from ..parallel.strategies import checked

ROUND_DIGITS = 4  # significant digits a searched float keeps: points closer than that are one point, trained once
# What the search itself sets for every trial, so a space may neither fix nor search it: why, and the search's
# own flag for it
SET_BY_SEARCH = {
    "out": "each trial runs in OUT/trials/NNNN of the search's --out",
    "resume": "a search run again queues its unfinished trials again by itself",
    "overwrite": "a search run again queues its unfinished trials again by itself",
    "devices": "the search's --devices-per-trial sets it",
    "threads_per_worker": "the search divides the cores among the trials running at once (--parallel)",
    "quiet": "trials run quiet (the search shows their progress)",
    "tensorboard": "trials write no TensorBoard files (trials.csv and the plots hold their results)",
    "logger": "the search's --logger sends each trial to its trackers (a child of the search's run) as it ends",
}
FIXED_BY_SEARCH = {"seed": "the search's --seed seeds every trial (a space may search it)"}
# each pool process loads the data once, for all its trials: a space may fix these, not search them
DATA_OPTIONS = {"dataset", "data_dir", "image_size", "val_size", "test_size", "labels", "cache_dir", "skip_bad_images",
                "download"}
NOT_SEARCHABLE = {*SET_BY_SEARCH, *DATA_OPTIONS}


@dataclass(frozen=True)
class Param:
    name: str
    choices: tuple | None = None  # a categorical parameter ...
    low: float | None = None  # ... or a range
    high: float | None = None
    log: bool = False

    @property
    def is_int(self) -> bool:
        return self.choices is None and isinstance(self.low, int) and isinstance(self.high, int)


@dataclass(frozen=True)
class Space:
    fixed: dict[str, Any]
    params: tuple[Param, ...]

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the choices (brute force), in a fixed order."""
        ranged = [p.name for p in self.params if p.choices is None]
        if ranged:
            raise UserError(f"grid search needs a list of choices for every parameter; {', '.join(ranged)} "
                            "is a range (use --sampler genetic, tpe or random, or list the values)")
        names = [p.name for p in self.params]
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(p.choices for p in self.params))]

    def size(self) -> int | None:
        """How many distinct points the space has; None when a parameter is a range of floats."""
        n = 1
        for p in self.params:
            if p.choices is not None:  # choices closer than the precision are one point
                n *= len({_rounded(c) if isinstance(c, float) else c for c in p.choices})
            elif p.is_int:
                n *= p.high - p.low + 1
            else:
                return None
        return n

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Draw one point from an Optuna trial (floats rounded to the space's precision)."""
        out = {}
        for p in self.params:
            if p.choices is not None:
                out[p.name] = trial.suggest_categorical(p.name, list(p.choices))
            elif p.is_int:
                out[p.name] = trial.suggest_int(p.name, p.low, p.high, log=p.log)
            else:
                value = trial.suggest_float(p.name, float(p.low), float(p.high), log=p.log)
                out[p.name] = min(max(_rounded(value), float(p.low)), float(p.high))
        return out

    def key(self, params: dict[str, Any]) -> tuple | None:
        """What makes two points the same training: every parameter, floats at the space's precision. None
        for a trial that has not drawn all of them yet."""
        if any(p.name not in params for p in self.params):
            return None
        return tuple(_rounded(params[p.name]) if isinstance(params[p.name], float) else params[p.name]
                     for p in self.params)


def _rounded(value: float) -> float:
    return float(f"{value:.{ROUND_DIGITS}g}")


def _bundled() -> dict[str, Any]:
    folder = resources.files(__package__) / "spaces"
    return {f.name[:-5]: f for f in folder.iterdir() if f.name.endswith(".yaml")}


def load(spec: str) -> Space:
    """A space from a YAML file, or a bundled one by name (mlp-mnist, cnn-mnist)."""
    bundled = _bundled()
    if spec in bundled:
        text = bundled[spec].read_text()
    else:
        try:
            text = Path(spec).read_text()
        except OSError as e:
            raise UserError(f"cannot read the space file {spec} ({e.strerror}); pass a YAML file or one of: "
                            f"{', '.join(sorted(bundled))}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"space file {spec} is not valid YAML ({str(e).splitlines()[0]})") from None
    return parse(data, spec)


def parse(data: Any, where: str = "the space") -> Space:
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict) or not data["params"]:
        raise UserError(f"{where} must be a mapping with 'params' (the parameters to search) and optionally "
                        "'fixed' (options every trial shares)")
    unknown = set(data) - {"fixed", "params"}
    if unknown:
        raise UserError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}; use 'fixed' and 'params'")
    if not isinstance(data.get("fixed") or {}, dict):
        raise UserError(f"{where}: 'fixed' must be a mapping of `paratrain train` options to values, "
                        "such as {model: cnn, epochs: 2}")
    fixed = {str(k).replace("-", "_"): v for k, v in (data.get("fixed") or {}).items()}
    for name in fixed:
        _check_name(name, where, "fix")
    params = []
    for raw_name, spec in data["params"].items():
        name = str(raw_name).replace("-", "_")
        _check_name(name, where, "search")
        if name in fixed:
            raise UserError(f"{where}: '{name}' is both fixed and searched; keep one")
        params.append(_param(name, spec, where))
    base = C.TrainConfig()
    for p in params:  # every value must make a valid config (checked now, not in trial 37)
        values = p.choices if p.choices is not None else (p.low, p.high)
        for v in values:
            try:
                checked(C.validate(C.from_dict({**fixed, p.name: v}, base)))
            except UserError as e:
                raise UserError(f"{where}: {p.name} = {v!r} is not a valid value ({e})") from None
    return Space(fixed, tuple(params))


def _check_name(name: str, where: str, how: str) -> None:
    """A key of 'fixed' (`how` "fix") or of 'params' ("search"): a `paratrain train` option the search leaves
    to the space."""
    if name in SET_BY_SEARCH or (how == "fix" and name in FIXED_BY_SEARCH):
        raise UserError(f"{where}: a space cannot {how} '{name}': {SET_BY_SEARCH.get(name) or FIXED_BY_SEARCH[name]}")
    if name in DATA_OPTIONS and how == "search":
        raise UserError(f"{where}: {name} can be fixed, not searched (each process of the search loads the data "
                        "once, for all its trials)")
    if name not in C.FIELDS:
        hint = C.did_you_mean(name, [f for f in C.FIELDS if f not in NOT_SEARCHABLE])
        raise UserError(f"{where}: '{name}' is not a `paratrain train` option" + (hint or "; see `paratrain train "
                                                                                       "--help`"))


def _param(name: str, spec: Any, where: str) -> Param:
    if isinstance(spec, list):
        if not spec or len(set(map(repr, spec))) != len(spec):
            raise UserError(f"{where}: {name} needs a list of distinct choices, not {spec!r}")
        return Param(name, choices=tuple(spec))
    if isinstance(spec, dict) and {"low", "high"} <= spec.keys() and set(spec) <= {"low", "high", "log"}:
        low, high, log = spec["low"], spec["high"], bool(spec.get("log", False))
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
        if not numeric or not low < high or (log and low <= 0):
            raise UserError(f"{where}: {name} range needs numbers low < high (and low > 0 with log), "
                            f"not {spec!r}")
        return Param(name, low=low, high=high, log=log)
    raise UserError(f"{where}: {name} must be a list of choices or a range {{low: A, high: B, log: false}}, "
                    f"not {spec!r}")
