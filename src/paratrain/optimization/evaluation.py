"""Accuracy and loss over a whole split, shared out over the workers."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..data.batches import eval_range
from ..data.transforms import BatchPipeline
from ..runtime.dist import DistContext, whole
from .losses import counted, cross_entropy


def evaluate(model: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, ctx: DistContext,
             batch_size: int, loss: Any = None, flip: bool = False, lockstep: bool = False,
             meter: Any = None) -> tuple[float, float]:
    """Accuracy and mean loss over the whole set: each worker takes a contiguous, unpadded share and
    the sums are all-reduced, so the figures are exactly those of the full set. `flip`: the outputs are
    the mean of the image's and its mirror image's (test-time augmentation, --test-flip). `lockstep`: every
    forward is a collective (a sharded model gathers its weights), so every worker runs as many, a worker
    whose share is shorter by one example running an empty batch last. `meter`: metrics.Meter, updated with
    every batch of this worker's share."""
    return totals(evaluate_share(model, pair, prep, ctx, batch_size, loss, flip, meter, lockstep), ctx)


def evaluate_share(model: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, ctx: DistContext,
                   batch_size: int, loss: Any = None, flip: bool = False, meter: Any = None,
                   lockstep: bool = True) -> torch.Tensor:
    """The sums (SUMS slots) of worker `ctx.rank`'s share of `ctx.world_size`, not yet reduced (evaluate's)."""
    with torch.no_grad():  # not a decorator: mutation testing (mutmut) leaves decorated functions alone
        return _evaluate(model, pair, prep, ctx, batch_size, loss, flip, lockstep, meter)


def _evaluate(model: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, ctx: DistContext,
              batch_size: int, loss: Any, flip: bool, lockstep: bool, meter: Any) -> torch.Tensor:
    x_all, y_all = pair
    share = eval_range(len(y_all), ctx.rank, ctx.world_size)
    longest = len(eval_range(len(y_all), 0, ctx.world_size)) if lockstep else len(share)  # rank 0's is longest
    sums = torch.zeros(SUMS, dtype=torch.float64, device=ctx.device)
    was_training = model.training
    model.eval()
    for start in range(share.start, share.start + longest, batch_size):
        start, stop = min(start, share.stop), min(start + batch_size, share.stop)
        x = prep.eval(x_all[start:stop])
        logits = scores(model(x))
        if flip:
            logits = (logits + scores(model(x.flip(3)))) / 2
        if stop == start:  # lock-step's empty batch: its forward ran, it adds nothing
            continue
        sums += batch_sums(logits, y_all[start:stop], loss)
        if meter is not None:
            meter.update(logits, y_all[start:stop])
    model.train(was_training)
    return sums


def scores(logits: torch.Tensor) -> torch.Tensor:
    """A forward's outputs as evaluation counts them: in float32 where a run's autocast made them bf16 or fp16
    (the mirror image's average, the loss and the metrics then taken as in a float32 run)."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


# a batch's loss sum, correct predictions, examples, examples with a class to predict, and what the loss is a
# mean over (the targets the built-in cross-entropy counts: a sequence's tokens; else the examples)
SUMS = 5


def classified(logits: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether accuracy means something for this batch: a score per class, and one class index an example."""
    return logits.dim() == 2 and y.dim() == 1 and not y.is_floating_point()


def batch_sums(logits: torch.Tensor, y: torch.Tensor, loss: Any = None) -> torch.Tensor:
    """One batch's SUMS slots, in float64: summed over batches and workers they give the figures of the whole
    set exactly. `loss`: the batch mean (None: the built-in cross-entropy, summed over the targets it counts)."""
    if loss is None:
        return _slots(cross_entropy(logits, y, reduction="sum").double(), logits, y, counted(y))
    # a user's loss is the batch mean; the network's own (a Hugging Face model's) a mean over what it `counts`
    return step_sums(loss(logits.float(), y), logits, y, getattr(loss, "counts", None))


def step_sums(loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, counts: Any = None) -> torch.Tensor:
    """A batch's figures in batch_sums' slots, from its mean loss: a mean over what `counts(y)` counts (the
    built-in cross-entropy's tokens: losses.counted), else over the examples."""
    weight = counts(y) if counts is not None else _number(len(y), y.device)
    return _slots(loss.double() * weight, logits, y, weight)


def _slots(loss_sum: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(loss sum, correct, count, classified count, weight) of a batch whose loss sum is known."""
    n = _number(len(y), logits.device)
    if not classified(logits, y):  # a regression's or a sequence's, say: no accuracy
        return torch.stack([loss_sum, torch.zeros_like(n), n, torch.zeros_like(n), weight])
    return torch.stack([loss_sum, (logits.argmax(1) == y).sum().double(), n, n, weight])


def _number(value: int, device: torch.device) -> torch.Tensor:
    """`value` as a float64 scalar filled on the device: torch.tensor(value, device=...) copies it from the host,
    which on a GPU waits for the work queued before it, once a batch."""
    return torch.full((), float(value), dtype=torch.float64, device=device)


def totals(sums: torch.Tensor, ctx: DistContext) -> tuple[float, float]:
    """Accuracy (NaN where the task has no classes) and mean loss from every worker's sums (collective)."""
    loss_sum, correct, count, with_class, weight = ctx.all_reduce_sum(sums).tolist()
    if count == 0 or weight == 0:
        return math.nan, math.nan
    return (correct / with_class if with_class else math.nan), loss_sum / weight


class WholeScores:
    """A model for evaluation whose scores come out whole (gathered where its head leaves them split over tensor
    parallelism's workers)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, x: Any) -> Any:
        return whole(self.module(x))
