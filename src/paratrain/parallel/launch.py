"""Start the workers of a plan: in this process, in N processes started here (forked from prefork.py's
forkserver, or spawned), or as this process's part of a group that torchrun formed (env.py says which).
What each worker does is the `target` it is given (training.worker.work, which this layer does not import);
the launcher's own concerns are the processes: their start, heartbeats, signals, restarts after a death, and
why a worker died.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from ..checkpoint.manager import RunCheckpoints
from ..config import TrainConfig
from ..core.errors import UserError, WriteFailed, one_line
from ..core.tracebacks import user_frame_in_text
from ..runtime import prefork
from ..runtime.interrupt import Stopped, came_early, restore
from ..runtime.oom import OomWatch
from ..runtime.proc import end_process, name_process, on_loopback, reserved_port, worker_name
from ..runtime.tcp_timeout import agent_wait
from .runplan import RunPlan, network_file

Target = Callable[..., "dict[str, Any] | None"]


def _worker(rank: int, world_size: int, port: int, plan: RunPlan, restarts: int, heartbeats: Any, steps: Any,
            result_queue: Any, environ: dict[str, str], streams: None, target: Target) -> None:
    """Entry point of a spawned worker: a UserError goes to the launcher (which raises it, so a Python
    caller gets the exception and the command line its one line) and becomes the exit code; a collective
    that timed out names the workers whose heartbeat stopped. `steps`: where each worker's last finished
    step is kept (shared), for the launcher to say when a worker died. `environ`: the launcher's environment;
    `streams`: its standard output and error, already adopted as the arguments were unpickled (prefork.Streams)."""
    prefork.detach(environ)
    plan = dataclasses.replace(plan, clock={**plan.clock, "worker_entered": time.time()})
    name_process(worker_name(rank))
    beat = threading.Thread(target=_beat, args=(heartbeats, rank), daemon=True)
    beat.start()
    on_loopback()
    try:
        summary = target(rank, world_size, rank, port, plan, describe_devices(plan), restarts,
                         on_step=partial(steps.__setitem__, rank))
        if summary is not None:
            result_queue.put(summary)
    except UserError as e:  # every worker may meet it (a NaN on one is seen by all); the launcher says one (_report_in)
        result_queue.put({"error": one_line(e), "code": e.code, "stopped": isinstance(e, Stopped), "rank": rank})
        end_process(e.code)
    except RuntimeError as e:
        if not _timed_out(e):
            raise
        silent = [r for r in range(world_size) if time.monotonic() - heartbeats[r] > 3 * HEARTBEAT_S]
        who = ", ".join(map(str, silent)) or "unknown (all heartbeats are recent)"
        print(f"paratrain: error: worker {rank}: a collective{_collective(e)} waited more than --collective-timeout "
              f"{plan.cfg.collective_timeout:g} s; the worker(s) that stopped answering: rank {who}", file=sys.stderr,
              flush=True)
        end_process(TIMEOUT_EXIT)
    end_process(0)


def _timed_out(e: RuntimeError) -> bool:
    """gloo and NCCL report a collective that waited too long as a RuntimeError that says so."""
    return "timed out" in str(e).lower() or "timeout" in str(e).lower()


def _collective(e: RuntimeError) -> str:
    """The collective that timed out, for the error's line, where the error names it (NCCL's blocking wait does:
    `WorkNCCL(SeqNum=5, OpType=ALLREDUCE, ...)`); "" where it does not (gloo's names the transport's receive)."""
    import re

    found = re.search(r"SeqNum=(\d+), OpType=(\w+)", str(e))
    return f" ({found[2]}, the group's collective number {found[1]})" if found else ""


HEARTBEAT_S = 0.5
TIMEOUT_EXIT = 4


def _beat(heartbeats: Any, rank: int) -> None:
    """A clock in shared memory that this process updates while it runs, even while its main thread waits
    inside a collective; a stopped or frozen process stops updating it."""
    while True:
        heartbeats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def describe_devices(plan: RunPlan) -> list[str]:
    """Each worker's device, for summary.json; the tower's, each GPU its one process drives (the MFU counts the
    peaks of the devices listed: a CPU's is its worker's threads', measured)."""
    threads = plan.hardware.threads_per_worker
    cpu = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
    gpus = [d for d in plan.layout.replicas if d.startswith("cuda")]
    return [f"{d} {torch.cuda.get_device_name(d)}" if d.startswith("cuda") else cpu for d in gpus or plan.devices]


def run(plan: RunPlan, target: Target) -> dict[str, Any] | None:
    """Run `target` (worker.work) on the plan's workers; returns rank 0's summary (None on other ranks of a
    launcher's group). A restart after a dead worker (--max-restarts) calls it again: the workers then carry
    on from the newest checkpoint in the run folder, as every start does."""
    cfg, env = plan.cfg, plan.env
    if env.in_group:
        # torchrun --max-restarts starts the workers again after a failure, on every node, but counts the
        # restart only on the node that failed: every start carries on from the newest checkpoint any node
        # has, and the group takes the highest count (checkpoint.agree).
        before = name_process(worker_name(env.rank))  # the user's script, when it calls paratrain.fit: renamed back
        try:
            return target(env.rank, env.world_size, env.local_rank, None, plan, None, env.restarts)
        except RuntimeError as e:
            if not _timed_out(e):
                raise
            # torchrun's summary names the first rank to exit: after a timeout, one that waited, not the culprit
            wait = agent_wait(cfg.collective_timeout) if env.nodes > 1 else ""
            if env.launcher == "slurm":  # srun's tasks meet at the step's first host: it may not have answered
                raise UserError(f"rank {env.rank}: the group did not form at {env.master_addr}:{env.master_port}, or "
                                f"a collective waited more than --collective-timeout {cfg.collective_timeout:g} s for "
                                "a task that stopped answering; where the first host does not resolve or the port "
                                "is taken, set MASTER_ADDR or MASTER_PORT in the job script", code=1) from None
            raise UserError(f"rank {env.rank}: a collective{_collective(e)} waited more than --collective-timeout "
                            f"{cfg.collective_timeout:g} s for a worker that stopped answering"
                            f"{' or a node the network cut off' if env.nodes > 1 else ''} (torchrun's report names "
                            f"the first rank to exit, which may be this one){'; ' + wait if wait else ''}",
                            code=1) from None
        finally:
            if before is not None:
                name_process(before)
    if plan.hardware.workers == 1:
        return target(0, 1, 0, None, plan, describe_devices(plan))
    for restarts in range(cfg.max_restarts + 1):
        try:
            return _spawn(plan, target, restarts)
        except WorkerFailed as e:
            # An exception in the user's code is not restarted: a resumed run replays the same steps exactly,
            # so it would raise again at the same step.
            if e.in_user_code or restarts == cfg.max_restarts:
                end_open_trackers(Path(cfg.out), cfg.logger)
            if e.in_user_code:
                raise UserError(f"{e}; the run stopped; the error is in your code (its traceback is above): fix it "
                                "and run again", code=1) from None
            if restarts == cfg.max_restarts:
                hint = "" if cfg.max_restarts else "; --max-restarts 1 (or more) restarts the run from its last " \
                    "checkpoint"
                raise UserError(f"{e}; the run stopped{hint}", code=1) from None
            print(f"paratrain: {e}; restarting all workers from the last checkpoint "
                  f"(restart {restarts + 1} of {cfg.max_restarts})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def end_open_trackers(run_dir: Path, logger: str | None) -> None:
    """The tracker runs of a run that failed, ended FAILED where rank 0 could not end them itself (killed outright:
    SIGKILL, the kernel's out-of-memory killer), by this launcher, which outlives it: with the records they lacked.
    A tracker that cannot be reached is one warning, as in a run."""
    from ..tracking.tracker_files import kept
    from ..tracking.trackers import named, send

    held = kept(run_dir)
    open_ = [n for n in named(logger) if held.get(n) and "ended" not in held[n]]
    if open_:
        send(run_dir, open_, lambda line: print(line, file=sys.stderr, flush=True), state="FAILED")


class WorkerFailed(Exception):
    """A worker died or failed (not a user error, not a requested stop): the group can be restarted.
    `in_user_code`: it raised in the user's own network, loss or optimizer."""

    def __init__(self, message: str, in_user_code: bool = False) -> None:
        super().__init__(message)
        self.in_user_code = in_user_code


MAIN_GUARD_EXIT = 5  # a spawned worker found the user's script calling fit as it was imported (api.fit)


def _spawn(plan: RunPlan, target: Target, restarts: int) -> dict[str, Any]:
    cfg = plan.cfg
    plan = dataclasses.replace(plan, clock={**plan.clock, "launched": time.time()})  # this attempt's (restarts)
    # in a Slurm job its warning before the end reaches every process of the step: the workers stop on it, and
    # this launcher waits for them as on SIGTERM; the forkserver and the resource tracker keep it blocked
    requeue_signal = plan.requeue_signal
    with reserved_port() as port:  # held for the workers: rank 0 binds it once it has started (seconds)
        prefork.warm_up(requeue_signal, network_file(cfg, plan.parts))
        method = prefork.start_method()
        smp = mp.get_context(method)
        results = smp.SimpleQueue()
        workers = plan.hardware.workers
        heartbeats = smp.Array("d", [time.monotonic()] * workers, lock=False)
        # by name: where a worker that dies before its first step was (a restart lists the folder anew)
        saved = (plan.checkpoints if restarts == 0 else RunCheckpoints(cfg.out).found()).newest_step
        steps = smp.Array("q", [saved or 0] * workers, lock=False)
        # The plan travels to the workers: its in-memory tensors through shared memory, a memory-mapped cache as
        # its path; each worker reads the checkpoint it carries on from itself (resume.py).
        # The environment and standard streams as they are now: a forked worker would otherwise have the
        # forkserver's, from its start.
        context = mp.start_processes(_worker, args=(workers, port, plan, restarts, heartbeats, steps, results,
                                                    dict(os.environ), prefork.streams(), target),
                                     nprocs=workers, join=False, start_method=method)
        try:
            finished = partial(_keep_summary, Path(cfg.out)) if plan.launcher_writes_summary else None
            return _join(context, results, steps, cfg, requeue_signal, finished)
        finally:
            results.close()  # its pipes now, not at the garbage collector's leisure


def _join(context: Any, results: Any, steps: Any, cfg: TrainConfig, requeue_signal: int | None = None,
          finished: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Wait for the workers; rank 0's summary, or the exception that says why the run ended. `requeue_signal`:
    a signal more that stops them (Slurm's requeue signal); `finished`: keeps rank 0's summary where the run
    ends in an error after rank 0 had finished it (_report_in)."""
    watch = OomWatch()
    # SIGINT too, not Python's KeyboardInterrupt: a launcher started with SIGINT ignored (a background job of a
    # script: the shell ignores it there, and Python keeps it ignored) would otherwise not stop on `kill -INT`,
    # while its workers and a one-process run do (interrupt.StopRequest), as torchrun's agent does
    old_handlers = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGINT, signal.SIGTERM, requeue_signal)
                    if s}
    try:
        if came_early(requeue_signal):  # Slurm's warning came while the run started: they stop at their first step
            raise _Terminated(requeue_signal)
        watch.note([p.pid for p in context.processes])
        while not context.join(timeout=0.5, grace_period=5):
            watch.note([p.pid for p in context.processes if p.is_alive()])
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        # What is known for sure comes first: a worker that said why it stopped (bad input, a NaN, a full disk),
        # then one the out-of-memory killer killed. The worker join() names may only have failed after them,
        # in a collective they had left.
        if (said := _report_in(results, finished) or _out_of_memory(context.processes, e.error_index, watch, steps)):
            raise said from None
        if isinstance(e, mp.ProcessRaisedException):  # a bug or a crash, not bad input: show its traceback
            raise _crashed(_first_cause(context, e)) from None
        # a worker's UserError (1: a failed write) or its stop on a signal (128 + its number): its message was lost
        if e.exit_code in (1, 2, 3) or 128 < e.exit_code < 160:
            raise _unreported(e.exit_code, cfg) from None
        if e.exit_code == MAIN_GUARD_EXIT:
            raise UserError("the workers import your script again (processes are spawned), and it calls paratrain.fit "
                            'when imported: put the call under `if __name__ == "__main__":`') from None
        how = "stopped answering" if e.exit_code == TIMEOUT_EXIT else f"died ({e.msg})"
        raise WorkerFailed(f"worker {e.error_index} {how}") from None
    except _Terminated as e:
        signum = e.signum
        for s in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C while they stop: they are stopping already
            if signal.getsignal(s) is _raise_terminated:
                signal.signal(s, _stopping)
        if signum == requeue_signal:  # rank 0 requeues the job; Slurm's SIGTERM to every process of the step follows at
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: this launcher waits for the workers and says why
        stop_processes(context.processes, signum, REQUEUE_WAIT_S if signum == requeue_signal else STOP_WAIT_S)
        raise _report_in(results, finished) or _unreported(128 + signum, cfg) from None
    finally:
        restore(old_handlers, _raise_terminated)
        restore(old_handlers, _stopping)
    if results.empty():
        raise UserError("the workers finished without a summary; see the lines above", code=1)
    return results.get()


# What a worker meets in a collective when another worker has died: a consequence, not the cause.
CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "DistBackendError", "DistNetworkError",
                "Broken pipe")


def _first_cause(context: Any, e: mp.ProcessRaisedException) -> mp.ProcessRaisedException:
    """The worker whose own error ended the run. join() names the first worker it saw fail, which may be one
    whose collective broke because another had died (gloo's "Connection closed by peer"); a worker that
    failed of anything else (its traceback written, as torch's workers write theirs) is the cause."""
    if not any(c in str(e) for c in CONSEQUENCES):
        return e
    for rank, path in enumerate(context.error_files):
        if rank == e.error_index or not path or not os.access(path, os.R_OK):
            continue
        with open(path, "rb") as f:
            trace = pickle.load(f)  # our own worker's traceback, as text (torch.multiprocessing writes it so)
        if isinstance(trace, str) and not any(c in trace for c in CONSEQUENCES):
            return mp.ProcessRaisedException(f"\n\n-- Process {rank} terminated with the following error:\n{trace}",
                                             rank, context.processes[rank].pid)
    return e


def _crashed(e: mp.ProcessRaisedException) -> WorkerFailed:
    print(str(e), file=sys.stderr, flush=True)
    last = str(e).strip().splitlines()[-1] if str(e).strip() else "an exception"
    where = user_frame_in_text(str(e))  # the user's own code on the stack: a bug a restart will not mend
    return WorkerFailed(f"worker {e.error_index} failed: {last}" + (f" (at {where})" if where else ""),
                        in_user_code=bool(where))


def _out_of_memory(processes: list, first: int, watch: Any, steps: Any) -> UserError | None:
    """A worker the out-of-memory killer killed (oom.py), in one line; not restarted: it would be killed again
    at the same step. None where no worker died so, or where it cannot be known. The worker that died first
    is asked first: join() kills the others with SIGKILL too, and they may share the victim's cgroup."""
    for rank in sorted(range(len(processes)), key=lambda r: r != first):
        p = processes[rank]
        if p.exitcode == -signal.SIGKILL and (cgroup := watch.killed(p.pid)) is not None:
            return UserError(f"worker {rank} was killed by the out-of-memory killer after step {steps[rank]} (its "
                             f"memory cgroup {cgroup} counts the kill); lower --batch-size (and raise --accumulate "
                             "by the same factor to keep the update's size), or give the workers more memory", code=1)
    return None


def _report_in(results: Any, finished: Callable[[dict[str, Any]], None] | None = None) -> UserError | None:
    """What a worker reported before it left (a UserError, or Stopped after a signal); None where none did.
    The first report, but of the workers' stops rank 0's: it acts for the job (requeues it), and its line says
    what was done, where another's only says that rank 0 does it. `finished(summary)`: given rank 0's summary,
    where rank 0 had finished the run before the others failed or a signal came (the run is done: it is kept)."""
    reports = []
    while not results.empty():
        item = results.get()
        if isinstance(item, dict) and "error" in item:
            reports.append(item)
        elif isinstance(item, dict) and finished is not None:
            finished(item)
    if not reports:
        return None
    first = reports[0]
    if first["stopped"]:
        first = next((r for r in reports if r["stopped"] and r.get("rank") == 0), first)
        return Stopped(first["error"], first["code"] - 128)
    return UserError(first["error"], code=first["code"])


def _keep_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Rank 0 had finished the run when a signal or another worker's failure ended it: its summary.json, which
    the session would have written, written here (without the shutdown time), so the finished run reads as one."""
    from ..tracking.log import write_summary

    try:
        write_summary(run_dir, summary)
    except WriteFailed as e:
        print(f"paratrain: warning: {e.path} could not be written ({e.cause.strerror})", file=sys.stderr, flush=True)


def _unreported(code: int, cfg: TrainConfig) -> UserError:
    """What is known when a worker left with `code` without saying why (a frozen worker, killed)."""
    if code > 128:  # a stop signal: SIGINT, SIGTERM, Slurm's requeue signal
        return Stopped(f"stopped by {signal.Signals(code - 128).name}; a worker that did not stop within "
                       f"{STOP_WAIT_S} s was killed, so the last checkpoint in {cfg.out} may be older than the last "
                       f"step; continue with --resume {cfg.out}", code - 128)
    what = "stopped" if code == 1 else "stopped on bad input"
    return UserError(f"a worker {what} without saying why (exit {code}); see the lines above", code=code)


class _Terminated(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


def _stopping(signum: int, frame: Any) -> None:
    """A stop signal while the workers stop on the first: they are killed when the wait ends (stop_processes)."""


STOP_WAIT_S = 8  # workers finish their step and save; then they are killed (the promise is 10 s)
REQUEUE_WAIT_S = 60  # Slurm's warning comes --signal-seconds (120 by default) before the end: a slow step may finish


def stop_processes(processes: list, signum: int, wait_s: float = STOP_WAIT_S) -> None:
    """Ctrl-C or SIGTERM: pass the signal on (each worker stops after its step, saves, exits), then make
    sure every worker is gone, so no process outlives the run."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signum)
    deadline = time.monotonic() + wait_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
