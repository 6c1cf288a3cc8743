"""Time spent on a device, summed without making the host wait for it: a pipeline's busy time and step time
(its measured bubble), which a device-wide synchronize around every chunk used to measure by serializing the
schedule it measured.

On a GPU an interval is a pair of CUDA events recorded on the current stream; the pairs are read once the
device has passed them (`Event.query`, which does not wait), and whatever is left at the end is read then.
On a CPU the work is done when the call returns, and the host's clock is the device's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch


class DeviceTime:
    """Seconds of device time in the intervals between `start()` and `stop(begun)`, summed."""

    def __init__(self, device: torch.device, event: Any = None) -> None:
        """`event`: the CUDA event class (a stand-in in the tests: torch.cuda.Event wants a GPU)."""
        self.on_device = device.type == "cuda"
        self.event = event or (torch.cuda.Event if self.on_device else None)
        self.pending: deque[tuple[Any, Any]] = deque()
        self.done_s = 0.0

    def start(self) -> Any:
        if not self.on_device:
            return time.perf_counter()
        begun = self.event(enable_timing=True)
        begun.record()
        return begun

    def stop(self, begun: Any) -> None:
        if not self.on_device:
            self.done_s += time.perf_counter() - begun
            return
        ended = self.event(enable_timing=True)
        ended.record()
        self.pending.append((begun, ended))
        self._read(wait=False)  # what the device has passed: the list stays short, and nothing waits

    def seconds(self) -> float:
        """The sum so far, every interval read (at a run's end: this waits for the device to get there)."""
        self._read(wait=True)
        return self.done_s

    def _read(self, wait: bool) -> None:
        while self.pending and (wait or self.pending[0][1].query()):
            begun, ended = self.pending.popleft()
            ended.synchronize()  # returns at once where query() said it is done
            self.done_s += begun.elapsed_time(ended) / 1000.0  # milliseconds
