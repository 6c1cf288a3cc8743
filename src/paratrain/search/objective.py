"""What a search optimises: one validation figure of every trial (its accuracy, its loss, or a metric that
--metric names), and which way is better."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import UserError


@dataclass(frozen=True)
class Objective:
    name: str  # accuracy, loss, or a metric's name
    maximize: bool

    @property
    def key(self) -> str:
        """The figure's key in a trial's summary (and in what its epochs report to the pruner)."""
        return f"val_{self.name}"

    @property
    def words(self) -> str:
        return f"validation {self.name}"

    @property
    def direction(self) -> str:
        return "maximize" if self.maximize else "minimize"

    def best(self, items: list[Any], value: Any = lambda v: v) -> Any:
        """The best of `items` by `value`."""
        return (max if self.maximize else min)(items, key=value)

    def order(self, value: float) -> float:
        """A sort key that puts the best first."""
        return -value if self.maximize else value


ACCURACY = Objective("accuracy", True)


def choose(name: str | None, metric: str | None, classification: bool, sequence: bool = False) -> Objective:
    """--objective checked against the data and the trials' --metric; None: the accuracy where the targets are
    classes, else the loss. `sequence`: the targets are token ids (perplexity means something)."""
    if name is None:
        return ACCURACY if classification else Objective("loss", False)
    if name == "accuracy":
        if not classification:
            raise UserError("--objective accuracy needs class targets, and this data's are not class indices: give "
                            "--objective loss, or a metric of --metric (mae, r2, ...)")
        return ACCURACY
    if name == "loss":
        return Objective("loss", False)
    from ..optimization.metrics import BUILT_IN, names  # (torch: not when the command line is only built)

    if name == "perplexity":
        if not sequence:
            raise UserError("--objective perplexity needs token-id targets (a language model's); choose loss")
        return Objective("perplexity", False)
    if name not in BUILT_IN:
        raise UserError(f"--objective {name} is not a figure a trial reports; choose accuracy, loss, perplexity, or "
                        f"a metric ({', '.join(BUILT_IN)}) that --metric names")
    if name not in names(metric):
        raise UserError(f"--objective {name}: the trials do not report it; add --metric {name}")
    return Objective(name, BUILT_IN[name][1])


def of_study(study: Any) -> Objective:
    """The objective a study was created with (a study of before --objective: the accuracy)."""
    from optuna.study import StudyDirection

    name = (study.user_attrs.get("search") or {}).get("objective", "accuracy")
    return Objective(name, study.direction == StudyDirection.MAXIMIZE)
