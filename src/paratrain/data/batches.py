"""Pure, seeded functions that decide which examples each worker sees.

The global batch at each step is the same whatever the number of workers: one seeded permutation
per epoch, global batch i is the i-th fixed slice of it, and worker r takes the r-th contiguous part
(the `tf.split` of the classic tower recipe). So N workers compute exactly the gradient of 1 worker.
"""

from __future__ import annotations

from typing import Any

import torch

from .source import read_on_demand


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the n training examples in `epoch`; a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def epoch_order(train_targets: Any, seed: int, epoch: int) -> torch.Tensor:
    """The training examples of `epoch` in order, by the index the training split reads them at: a
    permutation of every example, or text's windows by their first token (text.TokenWindows.epoch_starts)."""
    if hasattr(train_targets, "epoch_starts"):
        return train_targets.epoch_starts(seed, epoch)
    return epoch_permutation(len(train_targets), seed, epoch)


def order_device(train: tuple[Any, Any], device: torch.device) -> torch.device:
    """Where an epoch's order lives: on the host where the inputs are read from a file on demand (a text's
    windows, an image folder's cache: their indices are read on the host, and an order kept on the device would
    come back each micro-batch, a wait for the device; targets held on the device take their indices through
    feed.Feed, copied without waiting); else on the device with the data, which it indexes."""
    return torch.device("cpu") if read_on_demand(train[0]) else device


def global_batch(perm: torch.Tensor, step: int, batch_size: int) -> torch.Tensor:
    """Indices of global batch `step` (0-based within the epoch)."""
    return perm[step * batch_size: (step + 1) * batch_size]


def worker_part(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Worker `rank`'s contiguous share of a global batch whose size world_size divides."""
    if len(batch) % world_size:
        raise ValueError(f"a batch of {len(batch)} does not split evenly over {world_size} workers")
    per = len(batch) // world_size
    return batch[rank * per: (rank + 1) * per]


def eval_range(n: int, rank: int, world_size: int) -> range:
    """Worker `rank`'s contiguous share of an evaluation set: sizes differ by at most one, no padding,
    no duplicates, so summing the workers' counts gives exactly the whole set's accuracy."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
