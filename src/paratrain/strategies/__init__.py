"""How a model is spread over the workers. Data sharding itself lives in data/sharding.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import TrainConfig
from ..dist import DistContext
from .ddp import wrap as wrap_ddp
from .tower import Tower


def wrap(model: nn.Module, ctx: DistContext, cfg: TrainConfig) -> nn.Module:
    if cfg.strategy == "tower":
        n = int(cfg.devices)
        devices = [torch.device("cuda", i) for i in range(n)] if cfg.accelerator == "gpu" else [ctx.device] * n
        return Tower(model, devices)
    if cfg.strategy in ("pipeline", "hybrid"):  # the stage's layers; pipeline.py moves the data
        return model
    return wrap_ddp(model, ctx)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel | Tower) else model


def name(ctx: DistContext, cfg: TrainConfig) -> str:
    if cfg.strategy in ("tower", "pipeline", "hybrid"):
        return cfg.strategy
    return "ddp" if ctx.distributed else "single"


__all__ = ["name", "unwrap", "wrap"]
