"""The process that workers, a search's pool processes and a bench's runs are forked from: started early, it
imports torch while the launcher reads the data (the search opens its study).

A spawned worker spends ~1.5 s importing torch, and its first optimizer step ~1.7 s more importing
torch._dynamo (torch.optim's step imports it whether or not anything is compiled). A forkserver that has
them loaded forks workers that start in a moment; each is as fresh as a spawned one (it imports the user's
main script again, as spawn does). This module imports no torch, so the command line can start it first.

What a forked worker (or pool process) must undo to be as a spawned one (launch._worker and
runner.pool_worker call `detach`): it holds the launcher's end of the forkserver's lifeline (so a killed
launcher would leave the forkserver, and through it the workers, alive), SIGTERM ignored (the forkserver
ignores it: see _in_forkserver.py), and the environment and standard streams of the forkserver's start rather
than of the launch (handed over with the worker's arguments: `environ` and `Streams`). Linux only: elsewhere
workers are spawned, as multiprocessing's own defaults there advise (macOS's system frameworks are not fork-safe).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

PRELOAD = ["paratrain.runtime._in_forkserver", "torch", "torch._dynamo", "paratrain.training.worker",
           "paratrain.parallel.launch"]


def start_method() -> str:
    """forkserver on Linux; else spawn. PARATRAIN_START_METHOD=spawn asks for spawn (how workers started
    before; benchmarks/startup.py compares the two)."""
    if os.environ.get("PARATRAIN_START_METHOD") == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    return "forkserver"


# The heavy part of a library that a model's file imports, imported by the forkserver for the workers (through
# a module of ours that passes over any failure): every worker of a GPT-2 or a Llama of transformers' spent
# ~1.6 CPU-s importing transformers' modeling base (which its models share; 2 CPU-s with the model's own
# module). Importing it asks for no CUDA device (tested), so the workers forked after it still take their GPUs.
LIBRARIES = {"transformers": "paratrain.runtime._preload_transformers"}


def preload(model: str = "") -> list[str]:
    """What the forkserver imports: PRELOAD, and LIBRARIES' part of each library that the model's file
    (`--model path/to/file.py:factory`) imports. The file is read, never run: the user's code runs in the
    workers alone (it could ask for a GPU, which a process forked after cannot take). A library that is not
    installed, or fails to import, is passed over (and the run then fails in its own words)."""
    import ast

    from ..core.import_path import is_file, is_import_path

    head = model.rpartition(":")[0]
    if not (is_import_path(model) and is_file(head)):
        return PRELOAD
    try:
        tree = ast.parse(Path(head).expanduser().read_bytes())  # bytes: the file's own encoding line counts
    except (OSError, SyntaxError, ValueError):  # the run says what is wrong with the file
        return PRELOAD
    imported = {alias.name.partition(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.partition(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return PRELOAD + [LIBRARIES[name] for name in sorted(imported & LIBRARIES.keys())]


def warm_up(shield: int | None = None, model: str = "") -> None:
    """Start multiprocessing's helper processes now: its resource tracker, and the forkserver (it returns at
    once; the server imports in the background). Every later launch of this process reuses them. `shield`:
    in a Slurm job, its requeue signal (requeue.signal_for), blocked in them for life (shielded). `model`: the
    run's --model, whose file's libraries the forkserver imports too (`preload`)."""
    from multiprocessing import forkserver, resource_tracker

    with shielded(shield):
        resource_tracker.ensure_running()
        if start_method() == "forkserver":
            multiprocessing.get_context("forkserver").set_forkserver_preload(preload(model))
            forkserver.ensure_running()


@contextlib.contextmanager
def shielded(signum: int | None) -> Iterator[None]:
    """Block `signum` while helper processes start, which keep the mask for life.

    Slurm's warning before a job's end reaches every process of the step, and ends one that does not handle
    it: the forkserver would die, and with it (PR_SET_PDEATHSIG) every worker before it saves; the resource
    tracker would die and print tracebacks. A forked worker inherits the block and lets go of it as it
    installs its stop handler (interrupt.StopRequest), so a warning that came meanwhile is kept for it."""
    if signum is None:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def streams() -> Streams | None:
    """The launcher's standard streams for a forked worker (a spawned one has them already)."""
    return Streams() if start_method() == "forkserver" else None


def detach(environ: dict[str, str]) -> None:
    """In a process forked from the forkserver (a worker, a search's pool process, a bench's run), first thing:
    ask to die with its parent (proc.die_with_parent: the forkserver, or the launcher that spawned it); let go
    of the launcher's end of the forkserver's lifeline, which the forkserver hands every child (it exits when
    every end is closed, so a launcher killed with SIGKILL ends it, and PR_SET_PDEATHSIG then ends its
    children); take SIGTERM back, which the forkserver ignores; and take `environ`, the launcher's environment
    at the start (the forkserver's is of its own start). A spawned process has the launcher's already."""
    from multiprocessing import forkserver

    from .proc import die_with_parent

    die_with_parent()  # first: until the lifeline is let go of, the forkserver (its parent) cannot end
    server = forkserver._forkserver  # multiprocessing's own record of the lifeline in this process
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


class Streams:
    """The launcher's standard output and error as they are at the launch, for a worker to write to: a forked
    worker would otherwise write where the forkserver's pointed when it started (a caller may have
    redirected them since, as pytest's capture does). `out`, `err`: other descriptors of the launcher's to
    write to instead (a bench keeps a run's output in a file)."""

    def __init__(self, out: int = 1, err: int = 2) -> None:
        self.out, self.err = out, err

    def __reduce__(self) -> tuple:  # pickled as the worker is started: the files travel with it
        from multiprocessing.reduction import DupFd

        return (_adopt, (DupFd(self.out), DupFd(self.err)))


def _adopt(out: object, err: object) -> None:
    """In the worker, as its arguments are unpickled: point its standard output and error at the launcher's."""
    for handle, fd in ((out, 1), (err, 2)):
        received = handle.detach()
        if received != fd:
            os.dup2(received, fd)
            os.close(received)


def forks_for(devices: str, one_process: bool, in_group: bool) -> bool:
    """Whether the flags alone say that this run forks workers here: an explicit --devices N of more than one,
    not a layout whose `one_process` drives its devices (the tower), not a rank of torchrun's or srun's (they
    start their own).
    Never a guess: under --devices auto the plan decides (runplan.make starts the forkserver then)."""
    return devices.isdigit() and int(devices) > 1 and not one_process and not in_group
