"""Stopping on request: SIGINT (Ctrl-C) and SIGTERM become a flag that the training loop reads between
steps, so that every worker stops at the same step and a checkpoint is saved before they leave."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ..core.errors import UserError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Slurm's warning signals that came before a run could act on them (hold): kept for the run, which stops on its
# first step (a signal whose default action is to end the process would lose the job's requeue otherwise)
_EARLY: set[int] = set()


def hold(signals: tuple[int, ...]) -> None:
    """From a Slurm job's start until a run installs its own handlers, keep these signals instead of dying."""
    for signum in signals:
        signal.signal(signum, lambda number, _frame: _EARLY.add(number))


def came_early(signum: int | None) -> bool:
    return signum in _EARLY


class StopRequest:
    """A signal handler that only records which signal came; the loop decides when to act on it.
    `requeue_signal`: a signal more to stop on (Slurm's requeue signal, in a Slurm job)."""

    def __init__(self, requeue_signal: int | None = None) -> None:
        self.signum = 0
        self.requeue_signal = requeue_signal
        self.signals = SIGNALS + ((requeue_signal,) if requeue_signal else ())

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        # Slurm's warning, once come, stays: its SIGTERM may follow
        if self.signum != self.requeue_signal or not self.requeue_signal:
            self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGINT, SIGTERM (and `requeue_signal`) with this object while training (main thread only)."""
        old = {s: signal.signal(s, self) for s in self.signals}
        # a worker forked from the forkserver starts with the requeue signals blocked (prefork.shielded): a
        # warning that came since waits, and comes now, to this handler
        if hasattr(signal, "pthread_sigmask"):  # not on Windows
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        if came_early(self.requeue_signal):  # Slurm's warning came while the run started: it stops at its first step
            self.signum = self.requeue_signal
        try:
            yield self
        finally:
            restore(old, self)


def restore(old: dict[int, Any], mine: Any) -> None:
    """Put back the handlers `old` where `mine` still handles the signal; one set since (requeue.ask's
    SIG_IGN for the SIGTERM that follows a requeue) stays, with no moment between in which the signal would
    end the process."""
    for signum, handler in old.items():
        if signal.getsignal(signum) is mine:
            signal.signal(signum, handler)


class Stopped(UserError):
    """Training stopped on a signal (Ctrl-C's SIGINT, SIGTERM), after saving its checkpoint: the command exits with
    128 + the signal's number (130, 143); `paratrain.fit` raises it (`paratrain.Stopped`, a UserError whose
    message names the checkpoint and how to carry the run on). `signum`: the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message, code=128 + signum)
        self.signum = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def signal_number(name: str) -> int:
    """A signal's number from its name without SIG ("USR1")."""
    return int(signal.Signals[f"SIG{name}"])
