"""Synchronous data parallelism: a replica per worker, gradients averaged by DDP's all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .base import Strategy

if TYPE_CHECKING:
    import torch

    from ..phases import PhaseTimer


class DataParallel(Strategy):
    name = "ddp"

    def wrap(self) -> None:
        """DDP for several workers (it broadcasts rank 0's weights, then averages every gradient);
        the bare model for one, where an all-reduce would only cost time."""
        from torch.nn.parallel import DistributedDataParallel

        if not self.ctx.distributed:
            return
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step.
        self.model = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # DDP all-reduces in the backward pass; no_sync leaves the gradients to accumulate locally
        no_sync = self.model.no_sync() if self.ctx.distributed and not sync else contextlib.nullcontext()
        with no_sync:
            return super().forward_backward(x, y, sync, backward)

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        timer.allreduce_gradients(self.module)  # --time-phases: the all-reduce DDP was told to skip

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "strategy": "ddp" if self.ctx.distributed else "single"}
