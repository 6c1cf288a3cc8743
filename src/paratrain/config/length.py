"""A run's length (updates, epochs) from its configuration and its data, the refusal to carry a run on past
it, and the seed of each worker's randomness at each step: pure functions, decided the same way everywhere."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.errors import UserError

if TYPE_CHECKING:
    from . import TrainConfig


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one worker's randomness (dropout, augmentation) at one step: a pure function, so a
    resumed run draws exactly what an uninterrupted one would, and workers draw differently."""
    return ((seed * 1_000_003 + step) * 4099 + rank) % (2**63)


def steps_per_epoch(n: int, global_batch: int) -> int:
    """Whole global batches per epoch: the partial last one is dropped by every worker alike."""
    return n // global_batch


@dataclass(frozen=True)
class Length:
    per_epoch: int  # optimizer updates per epoch
    total_steps: int
    epochs: int


def run_length(cfg: TrainConfig, n_train: int) -> Length:
    """How many updates the run makes, and in how many epochs (--steps wins over --epochs)."""
    per_epoch = steps_per_epoch(n_train, cfg.batch_size * cfg.accumulate)
    if per_epoch == 0:
        given = (f"--batch-per-worker {cfg.batch_per_worker} (a global batch of {cfg.batch_size})"
                 if cfg.batch_per_worker else f"--batch-size {cfg.batch_size}")  # the flag the user gave
        raise UserError(f"{given} x --accumulate {cfg.accumulate} is more than the {n_train} training "
                        f"{'windows (of packed examples)' if cfg.pack else 'examples'}; lower them")
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    return Length(per_epoch, total, math.ceil(total / per_epoch))


def check_not_past(done: int, total: int, run_dir: str) -> None:
    """Refuse to carry on a run that has done more steps than the `total` this start asks for (it would be
    evaluated again under a configuration that says otherwise)."""
    if done > total:
        raise UserError(f"the run in {run_dir} has done {done} steps, more than the {total} asked for; give more "
                        f"steps (--steps or --epochs; steps= or epochs= in Python) to train it further, or evaluate "
                        f"it with `paratrain eval {run_dir}` (paratrain.evaluate)")
