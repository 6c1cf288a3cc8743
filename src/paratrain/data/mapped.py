"""Inputs of kind "tensors" that stay in their .npy file: a memory map, read a batch of rows at a time, so
each worker reads only its share of each global batch and inputs larger than memory train (images have the
same in their decoded cache, source.py). It pickles as its path: a spawned worker opens the file itself,
instead of receiving a copy through shared memory.

It answers what the loop, the evaluation and the checks ask of an input tensor (`len`, `shape`, `dtype`,
`x[rows]`, `x[a:b]`, `.to(device)`), and converts as tensor_splits converts a tensor in memory: floats and
uint8 to float32, other integers to int64, a batch at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

CHUNK_ROWS = 65536  # rows read at once by the checks and statistics that pass over every row


def torch_dtype(kind: np.dtype) -> torch.dtype:
    """What an array of `kind` becomes: float32 for floats and bytes (as a network's weights are), int64 for
    other integers (token ids, class indices)."""
    return torch.float32 if kind.kind == "f" or kind == np.uint8 else torch.int64


class MappedTensor:
    """Rows `rows` (all, if None) of a `.npy` file, read on demand."""

    def __init__(self, path: str, rows: np.ndarray | None = None, device: torch.device | str = "cpu",
                 stamp: tuple[int, int, int] | None = None) -> None:
        self.path, self.rows, self.device = str(path), rows, torch.device(device)
        self.stamp = stamp or _stamp(self.path)  # the file it was made from: a file replaced since is refused
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:  # opened lazily: once per process, after unpickling too
            if _stamp(self.path) != self.stamp:
                from ..errors import UserError

                raise UserError(f"{self.path} was replaced while this run read it; run again")
            self._array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        return self._array

    @property
    def shape(self) -> torch.Size:
        n = len(self.rows) if self.rows is not None else self.array.shape[0]
        return torch.Size((n, *self.array.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
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

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """These rows (a tensor or array of indices, or a slice), converted, on this source's device."""
        if isinstance(idx, torch.Tensor):
            idx = idx.cpu().numpy()
        if isinstance(idx, int | np.integer):
            return self[[int(idx)]][0]
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx, dtype=np.int64)
        if self.rows is not None:
            idx = self.rows[idx]
        # sorted reads touch the file in order (fewer page faults); the rows go back in the asked order
        order = np.argsort(idx, kind="stable")
        out = np.empty((len(idx), *self.array.shape[1:]), dtype=self.array.dtype)
        out[order] = self.array[idx[order]]
        return torch.from_numpy(out).to(self.dtype).to(self.device)

    def chunks(self) -> Iterator[torch.Tensor]:
        """Every row, CHUNK_ROWS at a time, on the CPU (for the checks and statistics over the whole set)."""
        source = self if self.device.type == "cpu" else self.to("cpu")
        for start in range(0, len(self), CHUNK_ROWS):
            yield source[start:start + CHUNK_ROWS]

    def min(self) -> torch.Tensor:
        return torch.stack([c.min() for c in self.chunks()]).min()

    def max(self) -> torch.Tensor:
        return torch.stack([c.max() for c in self.chunks()]).max()

    def to(self, device: torch.device | str) -> MappedTensor:
        """The same rows, delivered on `device` (the file stays where it is)."""
        return MappedTensor(self.path, self.rows, device, self.stamp)

    def subset(self, rows: np.ndarray) -> MappedTensor:
        """Rows `rows` of these rows."""
        rows = np.asarray(rows, dtype=np.int64)
        return MappedTensor(self.path, rows if self.rows is None else self.rows[rows], self.device, self.stamp)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "device": str(self.device), "stamp": self.stamp}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["rows"], state["device"], tuple(state["stamp"]))  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"MappedTensor({self.path!r}, {len(self)} rows)"


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def take(x: Any, rows: torch.Tensor) -> Any:
    """Rows of an input tensor, or of a memory-mapped one (which stays mapped)."""
    return x.subset(rows.numpy()) if isinstance(x, MappedTensor) else x[rows]
