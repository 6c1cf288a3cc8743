"""--async-checkpoint: a checkpoint written while training goes on.

The loop waits only for the copy of the state it saves (on the CPU: a copy in memory; on a GPU: out of device
memory); the writing (DCP's save of a step folder) runs in a thread of this worker. One save at a time: the next
waits for the one before to finish, and the run waits for the last before it reports itself done. A kill during a
background save leaves the folder as a kill during a synchronous one does: the step folder is made visible by one
rename once whole, so the run carries on from the last complete checkpoint. A failed background write (a full
disk) is raised in the loop at the next wait.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


class Background:
    """One worker's background checkpoint writes, one at a time."""

    def __init__(self, ctx: Any) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        # DCP's background save agrees its plan and metadata across the ranks by collectives; on a group of their
        # own (gloo: async_save needs a CPU backend), they never meet the loop's collectives on the run's group.
        # Made by every rank at the same point of its set-up, as every group must be.
        self.group = dist.new_group(backend="gloo") if ctx.distributed else None
        if not ctx.distributed:  # DCP's thread warns, in a single process, that it assumes one: what is meant
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninit.*")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Run `write` in the background, once the previous write has finished."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # noqa: BLE001 (raised in the loop, at the next wait)
                self._error = e

        self._thread = threading.Thread(target=run, name="paratrain-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in progress has finished; its failure is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def staged(state: Any) -> Any:
    """A copy of `state`'s tensors on the CPU (containers copied, other values shared), which the training that
    goes on cannot change while it is written."""
    return tree_map_only(torch.Tensor, _to_cpu_copy, state)


def _to_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", non_blocking=False)  # a synchronous copy out of device memory
