"""The process that workers are forked from: started early, it imports torch while the launcher reads the data.

A spawned worker spends ~1.5 s importing torch, and its first optimizer step ~1.7 s more importing
torch._dynamo (torch.optim's step imports it whether or not anything is compiled). A forkserver that has
them loaded forks workers that start in a moment; each is as fresh as a spawned one (it imports the user's
main script again, as spawn does). This module imports no torch, so the command line can start it first.
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = ["torch", "torch._dynamo", "paratrain.train", "paratrain.launch"]


def start_method() -> str:
    """forkserver where there is one (Linux, macOS); else spawn. PARATRAIN_START_METHOD=spawn asks for spawn
    (how workers started before; benchmarks/startup.py compares the two)."""
    if os.environ.get("PARATRAIN_START_METHOD") == "spawn":
        return "spawn"
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def warm_up() -> None:
    """Start the forkserver now (it returns at once; the server imports in the background). Every later
    launch of this process reuses it."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


class Streams:
    """The launcher's standard output and error as they are at the launch, for a worker to write to: a forked
    worker would otherwise write where the forkserver's pointed when it started (a caller may have
    redirected them since, as pytest's capture does)."""

    def __reduce__(self) -> tuple:  # pickled as the worker is started: the files travel with it
        from multiprocessing.reduction import DupFd

        return (_adopt, (DupFd(1), DupFd(2)))


def _adopt(out: object, err: object) -> None:
    """In the worker, as its arguments are unpickled: point its standard output and error at the launcher's."""
    for handle, fd in ((out, 1), (err, 2)):
        received = handle.detach()
        os.dup2(received, fd)
        os.close(received)


def worth_warming(devices: str) -> bool:
    """Whether a run asked for `devices` will start worker processes here: not one worker, nor a machine
    of one core, nor a worker of torchrun's (which starts its own)."""
    torchrun = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return not torchrun and devices != "1" and (devices != "auto" or cores > 1)
