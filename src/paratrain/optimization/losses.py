"""The built-in losses a run is trained and judged with (--loss; paratrain.fit's loss= replaces them): the
loss decides the task, as the targets suggest by default (cross-entropy for integer targets: class indices,
or token ids; else the mean squared error)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..config import LOSSES, TrainConfig
from ..data.splits import IGNORE


def class_last(logits: torch.Tensor, targets: torch.Tensor) -> bool:
    """Scores laid out N x T x V against N x T targets (a language model's), rather than torch's N x V x T."""
    return logits.dim() > 2 and logits.shape[:-1] == targets.shape


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
                  reduction: str = "mean") -> torch.Tensor:
    """torch's cross-entropy, over class indices (N x K scores) or token ids (N x T targets against N x T x V
    scores, or torch's own N x V x T): the mean over the targets that count (IGNORE: not counted)."""
    tokens = targets.dim() > 1
    if class_last(logits, targets):
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if not tokens or reduction != "mean":  # class indices: torch's own mean, as it always was
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, label_smoothing=label_smoothing,
                               reduction=reduction)
    # tokens: a share of padding only (no counted token) gives 0 and no gradient, where torch's mean gives NaN
    summed = F.cross_entropy(logits, targets, ignore_index=IGNORE, label_smoothing=label_smoothing, reduction="sum")
    return summed / counted(targets).clamp(min=1).to(summed.dtype)


def counted(targets: torch.Tensor) -> torch.Tensor:
    """How many targets the cross-entropy counts (IGNORE's are not), as float64."""
    return (targets != IGNORE).sum().double()


def has_ignored(targets: Any) -> bool:
    """Whether integer targets in memory mark some positions IGNORE (padding); a text's windows never do."""
    return isinstance(targets, torch.Tensor) and not targets.is_floating_point() and bool((targets == IGNORE).any())


def token_weights(targets: torch.Tensor, batches: list[torch.Tensor], which: int, of: int,
                  shifted: bool = False) -> list[float]:
    """For each micro-batch of a step (the global batches' indices into `targets`), what this worker's mean
    loss is multiplied by so that the mean over the workers and micro-batches is the mean over every counted
    token of the step: its counted tokens x workers x micro-batches / the step's counted tokens. With padding,
    shares count unequal tokens, and a plain mean of their means would weigh a token of a short share more.
    `shifted`: the loss counts the labels from the second position on (a Hugging Face causal LM's own)."""
    from ..data.batches import worker_part

    def count(rows: torch.Tensor) -> float:
        return float(counted(targets[rows][:, 1:] if shifted else targets[rows]))

    step = sum(count(b) for b in batches)
    return [count(worker_part(b, which, of)) * of * len(batches) / step if step else 1.0 for b in batches]


FUNCTIONS = {"cross-entropy": cross_entropy, "mse": F.mse_loss, "l1": F.l1_loss, "smooth-l1": F.smooth_l1_loss,
             "bce": F.binary_cross_entropy_with_logits}
assert tuple(FUNCTIONS) == tuple(n for n in LOSSES if n not in ("auto", "model"))  # model: the network's own


def loss_name(cfg: TrainConfig, classification: bool, labelled: bool = False) -> str:
    """--loss, or auto's choice for the data: the network's own where its inputs hold labels (`labelled`: a
    Hugging Face batch's), cross-entropy for integer targets (`classification`: class indices, or token
    ids), else the mean squared error."""
    if cfg.loss != "auto":
        return cfg.loss
    return "model" if labelled else "cross-entropy" if classification else "mse"


def training_loss(cfg: TrainConfig, classification: bool = True) -> Any:
    """The batch-mean loss training minimises: cross-entropy against smoothed targets with --label-smoothing
    (evaluation keeps the plain one)."""
    name = loss_name(cfg, classification)
    if name == "cross-entropy" and cfg.label_smoothing:
        return partial(cross_entropy, label_smoothing=cfg.label_smoothing)
    return FUNCTIONS[name]


def evaluation_loss(cfg: TrainConfig, classification: bool) -> Any:
    """The loss evaluation reports: the training loss, unsmoothed; None for the plain cross-entropy
    (evaluation.batch_sums sums it exactly)."""
    name = loss_name(cfg, classification)
    return None if name == "cross-entropy" else FUNCTIONS[name]


def perplexity(loss: float) -> float:
    """exp of a mean cross-entropy in nats (inf past what a float holds)."""
    import math

    return math.exp(loss) if loss < 700 else math.inf
