"""Items sent from a thread of their own, in batches: for a client whose requests are synchronous (MLflow's), so
that the caller (the training loop) queues an item and never waits for a server's round trip."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class BatchSender:
    """`send` called from a daemon thread with the lists of items queued within `every_s` of each other, each list
    of at most `limit` by `size` (an item bigger than the limit goes alone). A failed `send` ends the thread: its
    error is raised by the next `put` or by `close`, and the items it did not take stay counted in `unsent`."""

    def __init__(self, send: Callable[[list[Any]], None], every_s: float, limit: int,
                 size: Callable[[Any], int] = lambda item: 1, name: str = "paratrain-sender") -> None:
        self.send, self.every_s, self.limit, self.size, self.name = send, every_s, limit, size, name
        self.queue: queue.Queue[Any] = queue.Queue()
        self.unsent = 0  # items queued and not yet taken (a failure leaves them unsent)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def put(self, item: Any) -> None:
        self._raise()
        if self.thread is None:  # daemon: a process that dies is never held up by its sender
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.unsent += 1
        self.queue.put(item)

    def close(self) -> None:
        """Wait until every item queued is sent; raise the error that stopped the sending, if one did."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            items = [self.queue.get()]
            until = time.monotonic() + self.every_s
            while items[-1] is not None and (left := until - time.monotonic()) > 0:
                try:
                    items.append(self.queue.get(timeout=left))
                except queue.Empty:
                    break
            last = items[-1] is None
            items = [i for i in items if i is not None]
            while items:
                batch, size = [], 0
                while items and (not batch or size + self.size(items[0]) <= self.limit):
                    size += self.size(items[0])
                    batch.append(items.pop(0))
                try:
                    self.send(batch)
                except Exception as e:  # raised in the caller's thread, by the next put or close
                    self.error = e
                    return
                self.unsent -= len(batch)
            if last:
                return
