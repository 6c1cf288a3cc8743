"""Inputs of kind "tensors" that stay in their .npy file: a memory map, read a batch of rows at a time, so
each worker reads only its share of each global batch and inputs larger than memory train (images have the
same in their decoded cache, source.py). It pickles as its path: a spawned worker opens the file itself,
instead of receiving a copy through shared memory.

It answers what the loop, the evaluation and the checks ask of an input tensor (`len`, `shape`, `dtype`,
`x[rows]`, `x[a:b]`, `.to(device)`), and converts as tensor_splits converts a tensor in memory: floats and
uint8 to float32, other integers to int64, a batch at a time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .source import MappedImages

CHUNK_ROWS = 65536  # rows read at once by the checks and statistics that pass over every row


def torch_dtype(kind: np.dtype) -> torch.dtype:
    """What an array of `kind` becomes: float32 for floats and bytes (as a network's weights are), int64 for
    other integers (token ids, class indices)."""
    return torch.float32 if kind.kind == "f" or kind == np.uint8 else torch.int64


class MappedTensor(MappedImages):
    """Rows `rows` (all, if None) of a `.npy` file of any numbers, read on demand and converted (the file,
    the rows, the device, pickling as a path: MappedImages')."""

    REPLACED = ""

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch_dtype(self.array.dtype)

    @property
    def ndim(self) -> int:
        return self.array.ndim

    def dim(self) -> int:
        return self.array.ndim

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return int(np.prod(self.shape))

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """These rows (a tensor or array of indices, or a slice), converted, on this source's device."""
        return super().__getitem__(idx).to(self.dtype)

    def chunks(self) -> Iterator[torch.Tensor]:
        """Every row, CHUNK_ROWS at a time, on the CPU (for the checks and statistics over the whole set)."""
        source = self if self.device.type == "cpu" else self.to("cpu")
        for start in range(0, len(self), CHUNK_ROWS):
            yield source[start:start + CHUNK_ROWS]

    def min(self) -> torch.Tensor:
        return torch.stack([c.min() for c in self.chunks()]).min()

    def max(self) -> torch.Tensor:
        return torch.stack([c.max() for c in self.chunks()]).max()

    def __repr__(self) -> str:
        return f"MappedTensor({self.path!r}, {len(self)} rows)"


def take(x: Any, rows: torch.Tensor) -> Any:
    """Rows of an input tensor, or of a memory-mapped one (which stays mapped)."""
    return x.subset(rows.numpy()) if isinstance(x, MappedTensor) else x[rows]
