"""Packing (--pack): the examples of a split, one to a window with the rest padding (instructions.windows), put
several to a window instead, so that a step computes on examples rather than padding.

- An example keeps its own inputs and targets; its positions count from 0, so the network sees each example at
  the positions it had alone. The inputs become named columns {"input_ids", "position_ids"}: an example begins
  where the positions do not go up by one (transformers' rule for packed sequences, masking_utils), and a
  network keeps attention within each (models/gpt.documents; a Hugging Face model by its position_ids, run
  without its key/value cache: components/adapt.py).
- An example's positions after its last counted target are left out: under causal attention nothing before
  them sees them, and they count no loss, so the loss and every gradient are those of the unpacked examples.
- Which examples share a window: best fit by decreasing length (each example into the fullest window it fits),
  a fixed choice for the run, so that the same file gives the same windows on every worker and at every resume.
- The loss is the mean over every counted token of the step as unpacked (losses.token_weights): a step over the
  same examples, packed or not, gives the same loss.
"""

from __future__ import annotations

import bisect

import torch

from .columns import Columns
from .splits import IGNORE


def lengths(y: torch.Tensor) -> torch.Tensor:
    """Each row's positions up to and including its last counted target (0 for a row that counts none)."""
    counted = y != IGNORE
    last = torch.where(counted, torch.arange(y.shape[1]), -1).max(dim=1).values
    return last + 1


def bins(sizes: list[int], capacity: int) -> list[list[int]]:
    """The rows by window: best fit by decreasing size (each into the window with the least room that takes it),
    the windows in the order they were opened, each window's rows in the order placed."""
    windows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, window), sorted: the best fit is the first that takes a row
    for row in sorted(range(len(sizes)), key=lambda r: (-sizes[r], r)):
        at = bisect.bisect_left(room, (sizes[row], -1))
        if at == len(room):
            windows.append([])
            left, window = capacity, len(windows) - 1
        else:
            left, window = room.pop(at)
        windows[window].append(row)
        if left - sizes[row] > 0:
            bisect.insort(room, (left - sizes[row], window))
    return windows


def pack(x: torch.Tensor, y: torch.Tensor) -> tuple[Columns, torch.Tensor, dict]:
    """Rows of one example each (N x T inputs and targets) as fewer windows of several: {"input_ids",
    "position_ids"} and their targets, and how full the windows are (the share of positions that hold an
    example's)."""
    context = x.shape[1]
    sizes = [int(n) for n in lengths(y)]
    groups = bins(sizes, context)
    ids = torch.zeros(len(groups), context, dtype=torch.int64)
    targets = torch.full((len(groups), context), IGNORE, dtype=torch.int64)
    positions = torch.zeros(len(groups), context, dtype=torch.int64)
    for w, rows in enumerate(groups):
        at = 0
        for r in rows:
            n = sizes[r]
            ids[w, at:at + n], targets[w, at:at + n] = x[r, :n], y[r, :n]
            positions[w, at:at + n] = torch.arange(n)
            at += n
        positions[w, at:] = torch.arange(context - at)  # the padding: an example of its own, that counts nothing
    used = sum(sizes)
    return (Columns({"input_ids": ids, "position_ids": positions}), targets,
            {"examples": len(sizes), "windows": len(groups),
             "fill": round(used / (len(groups) * context), 4) if groups else None})
