"""Stopping on request: SIGINT (Ctrl-C) and SIGTERM become a flag that the training loop reads between
steps, so that every worker stops at the same step and a checkpoint is saved before they leave."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from .errors import UserError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A signal handler that only records which signal came; the loop decides when to act on it. `also`: a
    signal more to stop on (Slurm's requeue signal, in a Slurm job)."""

    def __init__(self, also: int | None = None) -> None:
        self.signum = 0
        self.signals = SIGNALS + ((also,) if also else ())

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGINT, SIGTERM (and `also`) with this object while training (main thread only)."""
        old = {s: signal.signal(s, self) for s in self.signals}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


class Stopped(UserError):
    """Training stopped on a signal, after saving: exit with 128 + the signal's number (130, 143)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, code=128 + signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def signal_number(name: str) -> int:
    """A signal's number from its name without SIG ("USR1")."""
    return int(signal.Signals[f"SIG{name}"])
