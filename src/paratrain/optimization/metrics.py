"""Metrics beside the loss, over a whole split and exact across workers: the built-in names of --metric
(torchmetrics objects), a user's torchmetrics objects as they are, or a user's functions.

A torchmetrics object keeps sufficient statistics (sums, counts, or the examples themselves) that its own
`compute` gathers from every process, so each worker updates it with its unpadded share of the split and the
value is the one device's over the same examples. Its states are kept in float64, so the order of the sums
changes nothing that shows. A plain function `fn(outputs, targets)` is taken as a batch mean (as a loss is):
weighted by the batch's size, summed over batches and workers; a metric that is no mean (F1, AUROC) needs a
torchmetrics object."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..config import METRICS
from ..core.errors import UserError

# name -> (what it is, higher is better); built by _built_in
BUILT_IN: dict[str, tuple[str, bool]] = {
    "mae": ("mean absolute error", False),
    "mse": ("mean squared error", False),
    "rmse": ("root mean squared error", False),
    "r2": ("coefficient of determination R^2", True),
    "f1": ("F1 score, the mean over the classes (macro)", True),
    "precision": ("precision, the mean over the classes (macro)", True),
    "recall": ("recall, the mean over the classes (macro)", True),
}
assert tuple(BUILT_IN) == METRICS  # the names --metric offers
NEEDS_CLASSES = ("f1", "precision", "recall")
RESERVED = ("accuracy", "loss")  # the names of what every run reports already


def names(text: str | None) -> list[str]:
    """The built-in metrics a --metric value names, comma-separated (config.validate checked them)."""
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _built_in(name: str, num_classes: int, labels: int) -> Any:
    """`num_classes`: class-index targets' classes; `labels`: 0/1 targets' labels (a row each, or one: -1)."""
    import torchmetrics as tm
    from torchmetrics.wrappers import LambdaInputTransformer

    if name in NEEDS_CLASSES:
        kind = {"f1": tm.F1Score, "precision": tm.Precision, "recall": tm.Recall}[name]
        if labels:
            # a logit per label, thresholded at probability 0.5. torchmetrics decides per batch whether its
            # inputs are logits (any value outside 0..1), which would make the value depend on the batches:
            # it is given probabilities
            metric = kind(task="binary") if labels < 0 else kind(task="multilabel", num_labels=labels,
                                                                  average="macro")
            return LambdaInputTransformer(metric, transform_pred=torch.sigmoid)
        return kind(task="multiclass", num_classes=num_classes, average="macro")
    return {"mae": tm.MeanAbsoluteError, "mse": tm.MeanSquaredError, "r2": tm.R2Score,
            "rmse": lambda: tm.MeanSquaredError(squared=False)}[name]()


def check(metrics: Any) -> dict[str, Any]:
    """`metrics=` of paratrain.fit: a dict of names to torchmetrics objects or functions (or built-in names)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise UserError(f"metrics= takes a dict of names to metrics, e.g. {{'mae': torchmetrics.MeanAbsoluteError()}}"
                        f"; not a {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) or name in RESERVED:
            raise UserError(f"metrics=: {name!r} cannot name a metric; use letters, digits and _ (not "
                            f"{' or '.join(RESERVED)}, which every run reports)")
        if not (isinstance(metric, str) and metric in BUILT_IN) and not _is_torchmetric(metric) and \
                not callable(metric):
            raise UserError(f"metrics['{name}'] must be a torchmetrics object, a function (outputs, targets) -> "
                            f"the batch mean, or one of {', '.join(BUILT_IN)}; not a {type(metric).__name__}")
    return dict(metrics)


def _is_torchmetric(metric: Any) -> bool:
    return all(callable(getattr(metric, a, None)) for a in ("update", "compute", "reset", "sync"))


class Meter:
    """The metrics of one evaluation: fresh copies, updated batch by batch on this worker's share, computed
    over every worker's (`values` is a collective)."""

    def __init__(self, metrics: dict[str, Any], device: torch.device) -> None:
        self.device = device
        self.objects: dict[str, Any] = {}
        self.functions: dict[str, Callable[..., Any]] = {}
        for name, metric in metrics.items():
            if _is_torchmetric(metric):
                fresh = copy.deepcopy(metric).to(device)
                fresh.reset()
                for part in fresh.modules():  # a wrapper's metrics too (set_dtype does not reach them)
                    if hasattr(part, "set_dtype"):  # sums in float64: the workers' order of summing does not show
                        part.set_dtype(torch.float64)
                self.objects[name] = fresh
            else:
                self.functions[name] = metric
        # per function: (sum of batch means x batch sizes, examples)
        self.sums = torch.zeros(len(self.functions), 2, dtype=torch.float64, device=device)

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One batch of this worker's share (never an empty one)."""
        outputs = outputs.double()
        for metric in self.objects.values():
            metric.update(_like(outputs, targets), targets)
        for i, fn in enumerate(self.functions.values()):
            self.sums[i, 0] += torch.as_tensor(fn(outputs.float(), targets), dtype=torch.float64) * len(targets)
            self.sums[i, 1] += len(targets)

    def values(self, ctx: Any) -> dict[str, float]:
        """Every metric over every worker's share (collective: every worker calls it)."""
        out = {}
        with warnings.catch_warnings():  # a pipeline's earlier stages update nothing: their states are zeros
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            for name, metric in self.objects.items():
                out[name] = _number(name, metric.compute())
        if self.functions:
            sums = ctx.all_reduce_sum(self.sums.clone())
            for (name, _), (total, count) in zip(self.functions.items(), sums.tolist(), strict=True):
                out[name] = total / count if count else float("nan")
        return out


def _like(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One output an example against one target (N x 1 against N): the shape of the targets, as the mean
    squared error takes them."""
    if outputs.shape != targets.shape and outputs.numel() == targets.numel() and targets.is_floating_point():
        return outputs.reshape(targets.shape)
    return outputs


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    raise UserError(f"metric {name} computed a {type(value).__name__}"
                    f"{' of shape ' + str(tuple(value.shape)) if isinstance(value, torch.Tensor) else ''}, not one "
                    "number; give it a reduction to one (average='macro', say)")


def for_run(cfg_metric: str | None, given: dict[str, Any] | None, data: Any) -> dict[str, Any]:
    """The run's metrics by name (--metric's built-in names, then fit's metrics=), built for `data` (a Splits:
    its classes, or its labels where the targets are a row of floats an example, multi-label); each
    evaluation updates fresh copies of them (Meter)."""
    num_classes = data.num_classes
    chosen: dict[str, Any] = {name: name for name in names(cfg_metric)}
    chosen.update(given or {})
    built = {}
    for name, metric in chosen.items():
        if isinstance(metric, str):
            labels = _labels(data) if metric in NEEDS_CLASSES and not num_classes else 0
            if metric in NEEDS_CLASSES and not (num_classes or labels):
                raise UserError(f"--metric {metric} scores class predictions, and these targets are neither class "
                                "indices (one integer an example) nor labels (0/1 floats, one or a row an "
                                "example); choose mae, mse, rmse or r2")
            if metric not in NEEDS_CLASSES and num_classes:
                raise UserError(f"--metric {metric} compares numbers, and these targets are class indices: choose "
                                "f1, precision or recall (accuracy is reported already)")
            metric = _built_in(metric, num_classes, labels)
        built[name] = metric
    return built


def _labels(data: Any) -> int:
    """Labels of 0/1 float targets: -1 for one an example (binary), K for a row of K (multi-label); 0 for
    other targets. A memory map's targets are in memory (only inputs stay in files)."""
    y = data.train[1]
    if not y.is_floating_point() or len(data.target_shape) > 1 or not len(y) or \
            not bool(((y == 0) | (y == 1)).all()):
        return 0
    return -1 if not data.target_shape else data.target_shape[0]
