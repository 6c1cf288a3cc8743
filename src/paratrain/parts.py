"""What a user brings in place of the configuration's: a model factory, an optimizer factory, a loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _rebuild(blob: bytes) -> Parts:
    import pickle

    return Parts(*pickle.loads(blob))


@dataclass(frozen=True)
class Parts:
    """`model()` builds the network on the CPU (every worker calls it after seeding, so every replica starts
    the same); `optimizer(params)` makes the optimizer; `loss(logits, targets)` is the batch mean. None:
    the configuration's model, optimizer, or cross-entropy."""

    model: Callable[[], nn.Module] | None = None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    record: dict[str, Any] | None = None  # what they are, in words (own.check_and_describe), for the run's record

    def model_name(self) -> str:
        from .own import name_of

        return name_of(self.model)

    def __reduce__(self) -> tuple[Any, ...]:
        # Spawned workers receive their arguments pickled. cloudpickle sends a lambda or a local function
        # by value (plain pickle cannot), and a module-level one by reference, as pickle would.
        import cloudpickle

        return _rebuild, (cloudpickle.dumps((self.model, self.optimizer, self.loss, self.record)),)
