"""The built-in losses a run is trained and judged with (--loss; paratrain.fit's loss= replaces them): the
loss decides the task, as the targets suggest by default (cross-entropy for class indices, else the mean
squared error)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch.nn.functional as F

from ..config import LOSSES, TrainConfig

FUNCTIONS = {"cross-entropy": F.cross_entropy, "mse": F.mse_loss, "l1": F.l1_loss, "smooth-l1": F.smooth_l1_loss,
             "bce": F.binary_cross_entropy_with_logits}
assert tuple(FUNCTIONS) == tuple(n for n in LOSSES if n != "auto")


def loss_name(cfg: TrainConfig, classification: bool) -> str:
    """--loss, or auto's choice for the data: cross-entropy for class indices, else the mean squared error."""
    if cfg.loss != "auto":
        return cfg.loss
    return "cross-entropy" if classification else "mse"


def training_loss(cfg: TrainConfig, classification: bool = True) -> Any:
    """The batch-mean loss training minimises: cross-entropy against smoothed targets with --label-smoothing
    (evaluation keeps the plain one)."""
    name = loss_name(cfg, classification)
    if name == "cross-entropy" and cfg.label_smoothing:
        return partial(F.cross_entropy, label_smoothing=cfg.label_smoothing)
    return FUNCTIONS[name]


def evaluation_loss(cfg: TrainConfig, classification: bool) -> Any:
    """The loss evaluation reports: the training loss, unsmoothed; None for the plain cross-entropy
    (evaluation.batch_sums sums it exactly)."""
    name = loss_name(cfg, classification)
    return None if name == "cross-entropy" else FUNCTIONS[name]
