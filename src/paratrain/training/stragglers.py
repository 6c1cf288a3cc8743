"""Straggler accounting (summary.json's sync_wait_s and straggler): how long each worker waited for the
busiest one at the steps' synchronisation. Measured where a worker's own part of a step can be timed apart
from its waiting (a layout whose strategy says `waits_measurable`: data parallel, on the CPU; on a GPU the
host does not see the wait inside NCCL's all-reduce).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..runtime.dist import DistContext


class Stragglers:
    """This worker's busy time since the last agreement (its forward-backward until its gradients were ready,
    and its update), told to the others at the next one, and every worker's waits so far."""

    def __init__(self, ctx: DistContext, measurable: bool) -> None:
        self.ctx, self.measured = ctx, measurable and ctx.device.type == "cpu"
        self.busy = 0.0
        self.waits = torch.zeros(ctx.world_size, dtype=torch.float64, device=ctx.device)

    def worked(self, since: float, until: float | None = None) -> None:
        """This worker was busy from `since` to `until` (time.perf_counter; now where None)."""
        self.busy += (until or time.perf_counter()) - since

    def all_reduce(self, summed: torch.Tensor) -> torch.Tensor:
        """The agreement's all-reduce of `summed`, each worker's busy time riding along (one slot each): a worker
        waited, this step, for as long as the busiest worker was busy beyond it. A straggler's stall counts
        against it, wherever it falls in its own work; what the communication itself takes counts for no one.
        Returns the reduced `summed` (without the slots)."""
        if not (self.measured and self.ctx.distributed):
            self.busy = 0.0
            return self.ctx.all_reduce_sum(summed)
        busy = torch.zeros(self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
        busy[self.ctx.rank] = self.busy
        reduced = self.ctx.all_reduce_sum(torch.cat([summed, busy]))
        self.waits += reduced[len(summed):].max() - reduced[len(summed):]
        self.busy = 0.0
        return reduced[:len(summed)]

    def figures(self, train_time: float) -> dict[str, Any]:
        """Each worker's seconds spent waiting, and the straggler: the worker that waited least, where another
        waited more than 1 s and 10% of the training time (None where not measured)."""
        if not self.measured:
            return {"sync_wait_s": None, "straggler": None}
        waits = self.waits.tolist()
        straggler = waits.index(min(waits)) if max(waits) > max(1.0, 0.1 * train_time) else None
        return {"sync_wait_s": [round(w, 3) for w in waits], "straggler": straggler}


def held_back(summary: dict[str, Any], train_time: float) -> str | None:
    """The line rank 0 prints where one worker held the others back."""
    if summary.get("straggler") is None:
        return None
    return (f"paratrain: worker {summary['straggler']} held the others back: they waited up to "
            f"{max(summary['sync_wait_s']):.1f} s for it at the steps' all-reduce, of {train_time:.1f} s of "
            "training (summary.json: sync_wait_s)")
