"""Synchronous data parallelism: a replica per worker, gradients averaged by DDP's all-reduce."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..dist import DistContext


def wrap(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DDP for several workers (it broadcasts rank 0's weights, then averages every gradient);
    the bare model for one, where an all-reduce would only cost time."""
    if not ctx.distributed:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step.
    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
