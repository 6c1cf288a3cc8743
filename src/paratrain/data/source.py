"""Where a split's images live: an in-memory uint8 tensor, or rows of a memory-mapped uint8 cache file.

Both answer the same questions the loop and the evaluation ask of the images: how many (`len`), what shape
(`shape`), and "these rows, on this device" (`images[idx]` for a tensor of row indices or a slice). An
in-memory tensor is moved to the device once, whole; a `MappedImages` stays in the file (the page cache)
and copies only the rows asked for, so each worker reads only its own share of each global batch and a
dataset larger than memory trains. It pickles as its path: a spawned worker opens the file itself,
instead of receiving a copy of the data through shared memory.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch


def read_on_demand(part: Any) -> bool:
    """Whether a split's inputs or targets are rows read on the host as they are asked for (a memory map's, a
    text's windows, --host-data's), not a tensor that is indexed where it lies."""
    return getattr(part, "read_on_demand", False)


def host_rows(shape: tuple[int, ...], dtype: np.dtype, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """An empty host array for rows bound for `device`, and the tensor it is a view of: in pinned memory where
    `device` is a GPU, so that delivered() copies them without waiting (from pageable memory, a copy to a GPU
    waits for the work queued before it)."""
    if device.type != "cuda":
        rows = np.empty(shape, dtype=dtype)
        return rows, torch.from_numpy(rows)
    t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype, pin_memory=True)
    return t.numpy(), t


def delivered(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host rows (host_rows') on `device`: on a GPU, copied from pinned memory on the current stream without the
    host waiting (torch's pinned allocator keeps the buffer until the copy has run)."""
    return t.to(device, non_blocking=device.type == "cuda")


def host_indices(idx: torch.Tensor) -> np.ndarray:
    """Indices as a NumPy array, read back from the device only where they are on one (a host tensor's are
    taken as they are)."""
    return idx.numpy() if idx.device.type == "cpu" else idx.cpu().numpy()


class MappedImages:
    """Rows `rows` (all, if None) of an N x C x H x W uint8 `.npy` file, read on demand."""

    REPLACED = " (the cache was rebuilt: were its images changed?)"  # why the file changed under the run
    read_on_demand = True  # its rows are read from the file as they are asked for (read_on_demand())

    def __init__(self, path: str, rows: np.ndarray | None = None, device: torch.device | str = "cpu",
                 stamp: tuple[int, int, int] | None = None) -> None:
        self.path, self.rows, self.device = str(path), rows, torch.device(device)
        # the file this source was made from: a cache rebuilt since (a new file) must not be read as it
        self.stamp = stamp or _stamp(self.path)
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:  # opened lazily: once per process, after unpickling too
            if _stamp(self.path) != self.stamp:
                from ..core.errors import UserError

                raise UserError(f"{self.path} was replaced while this run used it{self.REPLACED}; run again")
            self._array = np.load(self.path, mmap_mode="r")
        return self._array

    @property
    def shape(self) -> torch.Size:
        n = len(self.rows) if self.rows is not None else self.array.shape[0]
        return torch.Size((n, *self.array.shape[1:]))

    dtype = torch.uint8

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """These rows (a tensor or array of indices, or a slice), as a uint8 tensor on this source's device."""
        if isinstance(idx, torch.Tensor):
            idx = host_indices(idx)
        if isinstance(idx, int | np.integer):
            return self[[int(idx)]][0]
        if self.rows is not None:
            idx = self.rows[idx]
        elif isinstance(idx, slice):  # a slice of a memory map is a view: copy it out of the file
            view = self.array[idx]
            rows, t = host_rows(view.shape, view.dtype, self.device)
            rows[...] = view  # a copy, writable
            return delivered(t, self.device)
        # Sorted reads touch the file in order (fewer page faults); the result is put back in the asked order.
        idx = np.asarray(idx, dtype=np.int64)
        order = np.argsort(idx, kind="stable")
        rows, t = host_rows((len(idx), *self.array.shape[1:]), self.array.dtype, self.device)
        rows[order] = self.array[idx[order]]
        return delivered(t, self.device)

    def to(self, device: torch.device | str) -> MappedImages:
        """The same rows, delivered on `device` (the file stays where it is)."""
        return type(self)(self.path, self.rows, device, self.stamp)

    def subset(self, rows: np.ndarray) -> MappedImages:
        """Rows `rows` of these rows."""
        return type(self)(self.path, rows if self.rows is None else self.rows[rows], self.device, self.stamp)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "device": str(self.device), "stamp": self.stamp}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["rows"], state["device"], tuple(state["stamp"]))  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"MappedImages({self.path!r}, {len(self)} rows)"


class HostRows:
    """Inputs held in host memory (--host-data), delivered a batch of rows at a time on `device`, as a memory map's
    are (pinned, copied without waiting; the loop's feed reads the next batch ahead): a dataset in memory too
    large for a GPU beside its model."""

    read_on_demand = True

    def __init__(self, data: torch.Tensor, device: torch.device | str) -> None:
        self.data, self.device = data, torch.device(device)
        self.shape, self.dtype = data.shape, data.dtype

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """These rows (host indices, or a slice), on the device."""
        rows = self.data[idx.cpu() if isinstance(idx, torch.Tensor) else idx]
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return delivered(rows, self.device)

    def dim(self) -> int:
        return self.data.dim()

    def is_floating_point(self) -> bool:
        return self.data.is_floating_point()

    def to(self, device: torch.device | str) -> HostRows:
        return type(self)(self.data, device)


Images = torch.Tensor | MappedImages


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns
