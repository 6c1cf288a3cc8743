"""The pool of processes that run a search's trials: started, watched (a dead one is replaced, its trial tried
once more), shown as a progress bar, and stopped with the search (Ctrl-C, a signal, Slurm's warning)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from ..core.errors import UserError
from ..runtime import prefork
from ..runtime.interrupt import Stopped
from .objective import of_study as objective_of


class Warned(BaseException):
    """Slurm's requeue signal reached the search (a BaseException, as Ctrl-C is: the pool stops on it)."""


@contextlib.contextmanager
def recorded(signum: int | None) -> Any:
    """Within it, `signum` (if any) is only recorded: yields `came()`, whether it came, which run_pool asks between
    its polls (Slurm's requeue signal: it raises Warned; SIGTERM: Stopped). Raised from the handler, the exception
    could land inside a storage call of the progress poll, leave PostgreSQL's connection mid-transaction, and end
    the search as a storage failure instead of a requeue or a stop."""
    import signal

    came: list[int] = []
    old = signal.signal(signum, lambda number, _frame: came.append(number)) if signum else None
    try:
        yield lambda: bool(came)
    finally:
        if signum:
            signal.signal(signum, old)


def run_pool(s: Any, sp: Any, base: dict[str, Any], parallel: int, threads: int, accelerator: str, study: Any,
             budget: int, ignored: int | None = None, started: list[int] | None = None,
             warned: Callable[[], bool] | None = None, terminated: Callable[[], bool] = lambda: False) -> None:
    """P worker processes run the trials; this one shows the progress (polling the storage), starts a new
    process where one died (its trial is tried once more, then failed: see studies.after_death), and makes
    sure none of them outlives the search."""
    import multiprocessing
    import multiprocessing.connection
    import signal

    from tqdm import tqdm

    from ..parallel.launch import stop_processes
    from . import study as studies

    start, ready = _starter(s, sp, base, parallel, threads, accelerator, ignored, started)
    processes = {i: start(i, ready) for i in range(parallel)}
    deaths, finished = 0, studies.counts(study)[0]  # deaths since a trial last finished
    # a log file gets a line per finished trial instead of a bar redrawn every second
    bar = tqdm(total=budget, desc="search", unit="trial", disable=not sys.stderr.isatty())
    try:
        while processes:
            multiprocessing.connection.wait([p.sentinel for p in processes.values()], timeout=1.0)
            if warned is not None and warned():  # the recorded signals (search/command.py), acted on between polls
                raise Warned
            if terminated():  # as Ctrl-C: unhandled, SIGTERM ended the search at once, and with it (their
                # forkserver gone) the pool processes, killed in the middle of a save
                raise Stopped("search stopped by SIGTERM: its running trials stopped at their step, to be tried "
                              "again; run the same command again to go on", signal.SIGTERM)
            if (now := studies.counts(study)[0]) > finished:  # the search moves on: its processes are sound
                deaths, finished = 0, now
            for index, process in list(processes.items()):
                if process.exitcode is None:
                    continue
                del processes[index]
                if ready is not None:  # the others need not wait for it
                    ready[parallel] = 1
                if process.exitcode != 0:
                    deaths += 1
                    _died(index, process, list(processes.values()), study, deaths, parallel)
                    processes[index] = start(index)
            _progress(bar, study)
    except BaseException:  # Ctrl-C, SIGTERM, or the storage failing under the progress poll: no process outlives us
        stop_processes(list(processes.values()), signal.SIGTERM if terminated() else signal.SIGINT)
        raise
    finally:
        with contextlib.suppress(Exception):  # the storage may be what failed
            _progress(bar, study)
        bar.close()


def _starter(s: Any, sp: Any, base: dict[str, Any], parallel: int, threads: int, accelerator: str,
             ignored: int | None, started: list[int] | None) -> tuple[Callable[..., Any], Any]:
    """How the pool starts its process `index` (forked from paratrain's forkserver, torch imported: a spawned
    one spent ~6 CPU-s importing torch and the search's modules before its first trial), and the flags its
    first processes wait on. The forkserver, started by the command (search/command.py) while the study opens,
    keeps `ignored` (the requeue signal the search handles) blocked."""
    import multiprocessing

    from . import runner

    context = multiprocessing.get_context(prefork.start_method())
    # The first processes take trials together: one that started faster once trained every trial before the
    # other had imported torch (a process that takes the place of a dead one waits for nobody). A flag per
    # process and a last one, "go on", with no lock: a process killed while it waits holds up nobody (a
    # multiprocessing.Barrier's wake-up waits for every sleeper, a dead one too, and hung the search).
    ready = context.Array("b", parallel + 1, lock=False) if parallel > 1 else None

    def start(index: int, ready: Any = None) -> Any:
        # the environment and standard streams as they are now, as a spawned process has them
        process = context.Process(target=runner.pool_worker, args=(index, s, sp, base, threads, accelerator, ignored,
                                                                   ready, dict(os.environ), prefork.streams()))
        with prefork.shielded(ignored):  # a forkserver that multiprocessing starts again keeps it blocked too
            process.start()
        if started is not None:
            started.append(process.pid)
        return process
    return start, ready


# more deaths than this (per process of the pool) with no trial finished between: a fault of the search itself
MAX_DEATHS_PER_PROCESS = 3


def _died(index: int, process: Any, others: list[Any], study: Any, deaths: int, parallel: int) -> None:
    """A pool process that ended with an error: the search's end where it stopped on bad input, a stop signal,
    or too many deaths with no trial finished between (the others stopped); else its trial is tried once more
    (studies.after_death) and a new process takes its place."""
    import signal

    from ..parallel.launch import stop_processes
    from . import study as studies

    if process.exitcode in (2, 130, 143):  # bad input (said in its line), Ctrl-C, SIGTERM: the end
        stop_processes(others, signal.SIGINT)
        raise UserError(f"search worker {index} stopped (exit code {process.exitcode}); run the same "
                        "command again to resume", code=process.exitcode)
    how = (f"killed by {signal.Signals(-process.exitcode).name}" if process.exitcode < 0 else
           f"exit code {process.exitcode}")
    what = studies.after_death(study, f"{socket.gethostname()}:{process.pid}", how)
    if deaths > MAX_DEATHS_PER_PROCESS * parallel:
        stop_processes(others, signal.SIGINT)
        raise UserError(f"the search's worker processes died {deaths} times with no trial finished "
                        f"between (the last: {how}); the search stopped: see the lines above, then "
                        "run it again to resume", code=1)
    print(f"search: worker process {index} died ({how}); {what}; a new one takes its place",
          file=sys.stderr, flush=True)


def _progress(bar: Any, study: Any) -> None:
    from . import study as studies

    finished = studies.counts(study)[0]
    values = [t.value for t in study.get_trials(deepcopy=False) if t.value is not None]
    objective = objective_of(study)
    if bar.disable and finished > getattr(bar, "shown", 0):  # a disabled bar counts nothing itself
        best = f", best {objective.words} {objective.best(values):.4g}" if values else ""
        print(f"search: {finished}/{bar.total} trials done{best}", flush=True)
        bar.shown = finished
    bar.update(max(0, finished - bar.n))
    if values:
        bar.set_postfix(best=f"{objective.best(values):.4g}")
