"""Synchronous data parallelism: a replica per worker, gradients averaged by DDP's all-reduce."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...data import Splits
    from ...optimization.phases import PhaseTimer


def _buffer_sync_flag() -> str:
    """DDP's option that broadcasts rank 0's buffers before every forward: torch 2.14 renamed
    broadcast_buffers to forward_sync_buffers; the older releases that pyproject allows know only the first."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


class _LastBucket:
    """When this worker's last bucket of gradients was ready to be all-reduced (its own backward done)."""

    ready: float | None = None


def _timed_allreduce(last, bucket):  # noqa: ANN001, ANN202 (DDP refuses a hook annotated otherwise than with its types)
    """DDP's all-reduce (the mean over the workers), noting when the last bucket was handed to it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if bucket.is_last():
        last.ready = time.perf_counter()
    return allreduce_hook(None, bucket)


class DDP(Strategy):
    name = "ddp"
    waits_measurable = True  # gradients_ready_at: its hook marks when this worker's own gradients were ready
    auto_devices = True
    channels_last = True  # a pipeline sends activations between processes, which wants the default layout
    synced_bn = False  # whether build() made the BatchNorm layers normalise over the global batch

    def build(self, model: nn.Module, data: Splits, loss: Any) -> nn.Module:
        """The model on this worker's device; under --batchnorm sync (on several workers) every BatchNorm
        layer normalises with the statistics of the whole global batch, as one device would."""
        from ...features.batchnorm import has_batchnorm, synchronise

        module = super().build(model, data, loss)
        if self.ctx.distributed and self.cfg.batchnorm == "sync" and has_batchnorm(module):
            self.module = self.model = synchronise(module, self.ctx.device)
            self.synced_bn = True
        return self.module

    def wrap(self) -> None:
        """DDP for several workers (it broadcasts rank 0's weights, then averages every gradient);
        the bare model for one, where an all-reduce would only cost time."""
        from torch.nn.parallel import DistributedDataParallel

        if not self.ctx.distributed:
            return
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step.
        # Synchronised BatchNorm layers keep equal buffers on every worker: broadcasting them each step
        # would only cost time. (Under --batchnorm local DDP gives every worker rank 0's before each forward.)
        self.model = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True,
                                             **{_buffer_sync_flag(): not self.synced_bn})
        if self.ctx.device.type == "cpu":  # on a GPU the host does not wait in the backward: nothing to time
            self.last_bucket = _LastBucket()
            self.model.register_comm_hook(self.last_bucket, _timed_allreduce)

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # DDP all-reduces in the backward pass; no_sync leaves the gradients to accumulate locally
        no_sync = self.model.no_sync() if self.ctx.distributed and not sync else contextlib.nullcontext()
        with no_sync:
            return super().forward_backward(x, y, sync, backward)

    def gradients_ready_at(self) -> float | None:
        last = getattr(self, "last_bucket", None)  # the hook is only where DDP runs on the CPU
        if last is None:
            return None
        ready, last.ready = last.ready, None
        return ready

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        timer.allreduce_gradients(self.module)  # --time-phases: the all-reduce DDP was told to skip
