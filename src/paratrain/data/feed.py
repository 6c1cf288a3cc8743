"""What keeps a GPU fed: the training loop's one way to its micro-batches (trainer._fetch).

A split held on the device whole is indexed there. A split read on the host (a memory-mapped image or token file:
source.py, text.py) is gathered into pinned memory and copied without waiting; on a GPU, the next micro-batch is
gathered and copied by a thread, on a stream of its own, while this one trains, and the loop's stream waits for
that copy alone (an event), not for the device. The thread reads what the loop would read, in the same order:
the batches are the same, so is every run's equality to one device.

On a CPU the copies are the data themselves and the cores are the workers': the micro-batch is read when it is
asked for, in the loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..core.errors import UserError
from .source import read_on_demand

Rows = Callable[[int], "torch.Tensor | None"]  # micro-batch number -> this worker's indices (None: past the epoch)


def placed(data: Any, device: torch.device, host_data: bool) -> Any:
    """The splits where training reads them: moved to the device whole, or (`host_data`, --host-data) with their
    inputs kept in host memory; a dataset that does not fit the device is one line that says so."""
    try:
        return data.to(device, inputs_on_host=host_data)
    except torch.OutOfMemoryError:
        raise UserError(f"the dataset does not fit in {device}'s memory ({data.bytes_in_memory() / 2**30:.1f} GiB "
                        "moved there whole); --host-data keeps it in host memory and copies each batch to the GPU, "
                        "or give it as an image folder or a .npy file, which are read a batch at a time") from None


def reads_ahead(train: tuple[Any, Any], device: torch.device) -> bool:
    """Whether the next micro-batch is read ahead: on a GPU, where the inputs are read on the host."""
    return device.type == "cuda" and read_on_demand(train[0])


class Feed:
    """The training split's micro-batches, `take(n, rows)` at a time: micro-batch n's rows, with n + 1's read ahead
    where `ahead`."""

    def __init__(self, train: tuple[Any, Any], device: torch.device, ahead: bool) -> None:
        self.x, self.y, self.device = train[0], train[1], device
        # the thread on the worker's GPU: a CUDA call from a thread left on GPU 0 makes a context there, for every
        # worker of the node (torch's own pin-memory thread sets its device first, for the same reason)
        on_gpu = device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="paratrain-feed",
                                       initializer=torch.cuda.set_device if on_gpu else None,
                                       initargs=(device,) if on_gpu else ()) if ahead else None
        self.stream = torch.cuda.Stream(device) if ahead and on_gpu else None
        self.next: tuple[int, Future] | None = None

    def take(self, n: int, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `n` (rows(n): this worker's indices), as (inputs, targets) on the device."""
        if self.pool is None:
            return self._read(rows(n))
        if self.next is not None and self.next[0] == n:
            batch, ready = self.next[1].result()
        else:  # the first of an epoch (or a resumed run's): read now, on the side stream as the others
            batch, ready = self._read_aside(rows(n))
        self.next = None
        then = rows(n + 1)
        if then is not None:
            self.next = (n + 1, self.pool.submit(self._read_aside, then))
        if ready is not None:  # this stream waits for the copy, and owns the tensors from here
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for t in batch:
                t.record_stream(current)
        return batch

    def _read(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.y
        if isinstance(y, torch.Tensor) and y.device != idx.device:  # targets on the device, the order on the host
            idx_y = idx.pin_memory().to(y.device, non_blocking=True) if y.device.type == "cuda" else idx.to(y.device)
            return self.x[idx], y[idx_y]
        return self.x[idx], y[idx]

    def _read_aside(self, idx: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
        """`_read` on the side stream (its copies queued there), with the event the loop's stream waits for."""
        if self.stream is None:
            return self._read(idx), None
        with torch.cuda.stream(self.stream):
            batch = self._read(idx)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return batch, ready

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
