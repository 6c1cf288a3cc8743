"""Where a training step's time goes: data, compute, gradient all-reduce, optimizer (--time-phases).

Timing a phase means synchronising the device around it, and DDP hides its all-reduce inside the
backward pass, so in this mode the loop runs the backward pass without DDP's all-reduce and averages
the gradients in one explicit all-reduce instead: the same numbers, each phase on its own clock.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

from torch import nn

from ..runtime.dist import DistContext, average_gradients

PHASES = ("data", "compute", "allreduce", "optimizer")
WARMUP_STEPS = 1  # the first step allocates every buffer: it is left out of the averages


class PhaseTimer:
    def __init__(self, ctx: DistContext, active: bool, allreduce: bool = True) -> None:
        """`allreduce`: the strategy reduces the gradients in a phase of their own (else inside the backward,
        which is then compute, and the all-reduce's figure is None: not measured, rather than 0)."""
        self.ctx, self.active, self.allreduce = ctx, active, allreduce
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    @property
    def separates_allreduce(self) -> bool:
        """The backward leaves the gradients unreduced, for the timed all-reduce after it (DDP's no_sync)."""
        return self.active and self.allreduce

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.active or self.steps < WARMUP_STEPS:
            yield
            return
        self.ctx.synchronize()
        start = time.perf_counter()
        yield
        self.ctx.synchronize()
        self.seconds[name] += time.perf_counter() - start

    def allreduce_gradients(self, model: nn.Module) -> None:
        """Average the gradients over the workers in one flat all-reduce (the timed stand-in for DDP's)."""
        if not (self.active and self.ctx.distributed):
            return
        with self.phase("allreduce"):
            average_gradients(model.parameters(), self.ctx.world_size)

    def per_step(self) -> dict[str, float] | None:
        timed = self.steps - WARMUP_STEPS
        if not self.active or timed < 1:
            return None
        return {name: None if name == "allreduce" and not self.allreduce else self.seconds[name] / timed
                for name in PHASES}
