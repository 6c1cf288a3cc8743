"""Optimizers, learning-rate schedules and weight averages, on torch.optim (lr_scheduler, swa_utils)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.swa_utils import AveragedModel

from ..config import TrainConfig


def make_optimizer(cfg: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "custom":
        from ..core.errors import UserError

        raise UserError("optimizer 'custom' is a factory of yours: pass it, paratrain.fit(optimizer=make_opt, ...)")
    wd = cfg.weight_decay
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=wd)
    if cfg.optimizer == "gd":  # the tutorials' GradientDescentOptimizer: SGD without momentum
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=wd)
    if cfg.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=wd)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=wd)
    if cfg.optimizer == "adadelta":
        return torch.optim.Adadelta(params, lr=cfg.lr, weight_decay=wd)
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamax":
        return torch.optim.Adamax(params, lr=cfg.lr, betas=betas, weight_decay=wd)
    if cfg.optimizer == "nadam":
        return torch.optim.NAdam(params, lr=cfg.lr, betas=betas, weight_decay=wd)
    if cfg.optimizer == "adamw":  # the decay decoupled from the gradient's moments (Loshchilov & Hutter)
        return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=wd)
    return torch.optim.Adam(params, lr=cfg.lr, betas=betas, weight_decay=wd)


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, steps_per_epoch: int) -> float:
    """The multiplier of --lr for the update that follows `step` completed updates: a pure function,
    so a resumed run has exactly the lr an uninterrupted one would."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = step - cfg.warmup_steps
    if cfg.lr_schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(t, span) / span))
    if cfg.lr_schedule in ("exponential", "step"):
        period = cfg.lr_decay_steps or cfg.lr_decay_epochs * steps_per_epoch
        periods = t / period
        if cfg.lr_schedule == "step" or cfg.lr_staircase:
            periods = math.floor(periods)
        return cfg.lr_decay_rate**periods
    return 1.0


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                   steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer update; its state (the update count) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, step, total_steps, steps_per_epoch))


def ema_decay(decay: float, num_updates: int) -> float:
    """TensorFlow's ExponentialMovingAverage(decay, num_updates), as the CIFAR-10 tutorial uses it: the
    decay ramps up as min(decay, (1 + n) / (10 + n)), so a young average is not stuck at the start."""
    return min(decay, (1 + num_updates) / (10 + num_updates))


def _by_kind(averaged: list[torch.Tensor], current: list[torch.Tensor]) -> list[tuple[list, list]]:
    """The pairs in groups that one foreach op takes: plain tensors, or DTensors of one device mesh (tensor
    parallelism leaves some layers whole beside the ones it splits, and fsdp over its copies shards on another
    mesh)."""
    groups: dict[object, tuple[list, list]] = {}
    for a, c in zip(averaged, current, strict=True):
        mine, theirs = groups.setdefault(getattr(a, "device_mesh", None), ([], []))
        mine.append(a)
        theirs.append(c)
    return list(groups.values())


def make_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """ema <- d * ema + (1 - d) * weights after every update, d = ema_decay(decay, updates so far);
    the first update copies the weights. Buffers are averaged too (BatchNorm's running statistics belong
    to the averaged weights, as in timm's ModelEmaV2); counters are copied."""

    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        for mine, theirs in _by_kind(averaged, current):
            if not mine[0].is_floating_point():  # a counter (BatchNorm's num_batches_tracked): the latest
                torch._foreach_copy_(mine, theirs)
            else:
                torch._foreach_lerp_(mine, theirs, 1 - ema_decay(decay, int(num_averaged)))

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)
