"""Start the workers: spawn them on this machine, or join the group torchrun made.

This module reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...); prefork.py, which must not
import torch, says whether torchrun started this process (`under_torchrun`, used here too) and reads
PARATRAIN_START_METHOD.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.multiprocessing as mp

from . import dist, prefork
from .config import TrainConfig
from .devices import Plan, usable_cores
from .errors import UserError, one_line
from .interrupt import Stopped, StopRequest
from .partition import agent_wait

if TYPE_CHECKING:
    from .runplan import RunPlan

under_torchrun = prefork.under_torchrun


def torchrun_ranks() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def local_workers() -> int:
    """How many workers torchrun started on this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", torchrun_ranks()[1]))


def torchrun_plan(accelerator: str, threads_per_worker: int | None) -> Plan:
    """The plan torchrun imposes: its world size, and this node's cores shared by its local workers."""
    _, world_size, local_rank = torchrun_ranks()
    on_node = local_workers()
    n_gpus = torch.cuda.device_count()
    if accelerator == "auto":
        accelerator = "gpu" if n_gpus else "cpu"
    if accelerator == "gpu" and local_rank >= n_gpus:
        raise UserError(f"torchrun started {on_node} workers on this node but it has {n_gpus} GPU(s); "
                        f"use --nproc-per-node {n_gpus} or --accelerator cpu")
    threads = threads_per_worker or max(1, usable_cores() // on_node)
    return Plan(accelerator, world_size, threads, "nccl" if accelerator == "gpu" else "gloo")


def tune_malloc() -> None:
    """Keep freed activation buffers in the heap instead of returning them to the kernel.

    With glibc's defaults, every large batch-sized buffer is mmap'd and unmapped each step; at batch
    512 that cost 20-50% of CPU time in page faults on the build machine (DESIGN.md). mallopt does at
    run time what GLIBC_TUNABLES would do at start-up, so it also works in this very process.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's ceiling for this knob on 64-bit
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    libc.mallopt(M_TOP_PAD, 256 * 2**20)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: this worker is killed when the process that started it dies: the forkserver, which ends when the
    launcher does (prefork.detach), or the launcher that spawned it (a search's pool process killed for
    memory must not leave its trial's workers running on GPUs a new trial is given)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass


def name_process(name: str) -> str | None:
    """Linux: call this process `name` (at most 15 bytes) in `ps -o comm`, `top` and `pgrep`, since forked
    workers show their forkserver's command line, the same for every rank. Returns the name it had."""
    try:
        before = Path("/proc/self/comm").read_text().strip()
        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        return before
    except (OSError, AttributeError):  # not Linux
        return None


def worker_name(rank: int) -> str:
    return f"paratrain-w{rank}"


def on_loopback() -> None:
    """Keep this spawned worker's connections on the loopback interface: gloo (and NCCL's bootstrap) would
    otherwise listen on the address the hostname resolves to, which may be reachable from other machines.
    (The rendezvous store listens on 127.0.0.1: dist.loopback_store.) Not under torchrun, whose workers
    must reach other nodes."""
    loopback = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]  # Linux, BSD/macOS
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback[0]


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # the loop issues one op at a time; spare threads only contend
    except RuntimeError:  # already set in this process (in-process runs, tests)
        pass


def _train_here(rank: int, world_size: int, local_rank: int, local_port: int | None, plan: RunPlan,
                devices: list[str] | None, restarts: int = 0, find_checkpoint: bool = False,
                on_step: Callable[[int], None] | None = None) -> dict[str, Any] | None:
    """This process as one worker: tune it, join the group, train, leave the group.
    `find_checkpoint`: carry on from the newest checkpoint that any worker of the group was given or finds
    in --out (torchrun, where each node has its own disk). `on_step(step)`: after each update."""
    from .checkpoint import newest_in_group
    from .train import check_not_past, fit, run_length

    cfg = plan.cfg
    entered = plan.clock.get("worker_entered", time.time())  # in-process: the launch, a moment ago
    tune_malloc()
    _set_threads(plan.hardware.threads_per_worker)
    ctx = dist.init(rank, world_size, plan.devices[local_rank], local_port, cfg.collective_timeout)
    plan = dataclasses.replace(plan, clock={**plan.clock, "worker_entered": entered, "joined": time.time()})
    try:
        if find_checkpoint:
            given = plan.resume is not None
            resume, restarts = newest_in_group(ctx, *_offer(cfg, plan.resume), restarts)
            if resume is not None and not given:
                plan = plan.carried_on(resume, cfg.out)
                if ctx.is_main:
                    print(f"paratrain: carrying on from the checkpoint of step {resume['step']} found in {cfg.out}",
                          file=sys.stderr, flush=True)
            else:
                plan = dataclasses.replace(plan, resume=resume)
            if resume is not None:  # every worker holds the same checkpoint step: all refuse alike
                check_not_past(resume["step"], run_length(cfg, len(plan.data.train[1])).total_steps, cfg.out)
        with StopRequest().installed() as stop:
            return fit(ctx, plan, devices=devices, stop=stop, restarts=restarts, on_step=on_step)
    finally:
        dist.teardown(ctx)


def _worker(rank: int, world_size: int, port: int, plan: RunPlan, restarts: int, heartbeats: Any, steps: Any,
            result_queue: Any, environ: dict[str, str], streams: None = None) -> None:
    """Entry point of a spawned worker: a UserError goes to the launcher (which raises it, so a Python
    caller gets the exception and the command line its one line) and becomes the exit code; a collective
    that timed out names the workers whose heartbeat stopped. `steps`: where each worker's last finished
    step is kept (shared), for the launcher to say when a worker died. `environ`: the launcher's environment;
    `streams`: its standard output and error, already adopted as the arguments were unpickled (prefork.Streams)."""
    prefork.detach()
    plan = dataclasses.replace(plan, clock={**plan.clock, "worker_entered": time.time()})
    if isinstance(plan.resume, prefork.Packed):
        plan = dataclasses.replace(plan, resume=plan.resume.unpack())
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    _die_with_parent()
    name_process(worker_name(rank))
    beat = threading.Thread(target=_beat, args=(heartbeats, rank), daemon=True)
    beat.start()
    on_loopback()
    try:
        summary = _train_here(rank, world_size, rank, port, plan, describe_devices(plan), restarts,
                              on_step=partial(steps.__setitem__, rank))
        if summary is not None:
            result_queue.put(summary)
    except UserError as e:  # every worker may meet it (a NaN on one is seen by all); the launcher reads the first
        result_queue.put({"error": one_line(e), "code": e.code, "stopped": isinstance(e, Stopped)})
        end_process(e.code)
    except RuntimeError as e:
        if not _timed_out(e):
            raise
        silent = [r for r in range(world_size) if time.monotonic() - heartbeats[r] > 3 * HEARTBEAT_S]
        who = ", ".join(map(str, silent)) or "unknown (all heartbeats are recent)"
        print(f"paratrain: error: worker {rank}: a collective waited more than --collective-timeout "
              f"{plan.cfg.collective_timeout:g} s; the worker(s) that stopped answering: rank {who}", file=sys.stderr,
              flush=True)
        end_process(TIMEOUT_EXIT)
    end_process(0)


def end_process(code: int) -> NoReturn:
    """Leave a process that was in a process group without Python's finalization.

    A gloo worker thread can still hold the last reference to a tensor of a finished collective when the
    main thread exits; if it lets go while the interpreter is finalizing, it cannot take the GIL and the
    process aborts (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489).
    DDP keeps the process group alive past destroy_process_group, so its threads cannot be joined first.
    That happened at the end of about 1 run in 8 with 2 workers here. The run's files are closed by then
    (metrics.jsonl is flushed at every line, the result queue is written at once, and the Trainer closes
    TensorBoard however the run ends, a timed-out collective included)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _timed_out(e: RuntimeError) -> bool:
    """gloo and NCCL report a collective that waited too long as a RuntimeError that says so."""
    return "timed out" in str(e).lower() or "timeout" in str(e).lower()


HEARTBEAT_S = 0.5
TIMEOUT_EXIT = 4


def _beat(heartbeats: Any, rank: int) -> None:
    """A clock in shared memory that this process updates while it runs, even while its main thread waits
    inside a collective; a stopped or frozen process stops updating it."""
    while True:
        heartbeats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def describe_devices(plan: RunPlan) -> list[str]:
    """Each worker's device, for summary.json."""
    threads = plan.hardware.threads_per_worker
    cpu = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
    return [f"{d} {torch.cuda.get_device_name(d)}" if d.startswith("cuda") else cpu for d in plan.devices]


def run(plan: RunPlan) -> dict[str, Any] | None:
    """Run training on the plan's workers; returns rank 0's summary (None on other torchrun ranks)."""
    cfg = plan.cfg
    if under_torchrun():
        rank, world_size, local_rank = torchrun_ranks()
        # torchrun --max-restarts starts the workers again after a failure, on every node, but counts the
        # restart only on the node that failed: so every start looks for a checkpoint in --out and carries
        # on from the newest one any node has (rank 0 writes them, on its own disk).
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        before = name_process(worker_name(rank))  # the user's script, when it calls paratrain.fit: renamed back
        try:
            return _train_here(rank, world_size, local_rank, None, plan, None, restarts, find_checkpoint=True)
        except RuntimeError as e:
            if not _timed_out(e):
                raise
            # torchrun's summary names the first rank to exit: after a timeout, one that waited, not the culprit
            nodes = world_size > local_workers()
            wait = agent_wait(cfg.collective_timeout) if nodes else ""
            raise UserError(f"rank {rank}: a collective waited more than --collective-timeout "
                            f"{cfg.collective_timeout:g} s for a worker that stopped answering"
                            f"{' or a node the network cut off' if nodes else ''} (torchrun's report names the "
                            f"first rank to exit, which may be this one){'; ' + wait if wait else ''}",
                            code=1) from None
        finally:
            if before is not None:
                name_process(before)
    if plan.hardware.workers == 1:
        return _train_here(0, 1, 0, None, plan, describe_devices(plan))
    for restarts in range(cfg.max_restarts + 1):
        try:
            return _spawn(plan, restarts)
        except WorkerFailed as e:
            # An exception in the user's code is not restarted: a resumed run replays the same steps exactly,
            # so it would raise again at the same step.
            if e.in_user_code:
                raise UserError(f"{e}; the run stopped; the error is in your code (its traceback is above): fix it "
                                "and run again", code=1) from None
            if restarts == cfg.max_restarts:
                hint = "" if cfg.max_restarts else "; --max-restarts R restarts the run from its last checkpoint"
                raise UserError(f"{e}; the run stopped{hint}", code=1) from None
            print(f"paratrain: {e}; restarting all workers from the last checkpoint "
                  f"(restart {restarts + 1} of {cfg.max_restarts})", file=sys.stderr, flush=True)
            plan = plan.carried_on(_last_checkpoint(cfg), cfg.out)
    raise AssertionError("unreachable")


def _offer(cfg: TrainConfig, resume: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """What this worker brings to the group's choice of checkpoint: the one it was given (--resume) or the
    one in its --out, or why that one cannot be used (every worker then stops with that message)."""
    if resume is not None:
        return resume, None
    try:
        found = _last_checkpoint(cfg)
    except UserError as e:
        return None, str(e)
    from .checkpoint import model_mismatch

    if found is not None and (why := model_mismatch(found, cfg.model, cfg.out)):
        return None, f"{why}; pass another --out for a new run"
    return found, None


def _last_checkpoint(cfg: TrainConfig) -> dict[str, Any] | None:
    """The newest checkpoint of the run in --out that loads (None where it has none)."""
    from .checkpoint import newest_loadable

    return newest_loadable(Path(cfg.out) / "checkpoints")


class WorkerFailed(Exception):
    """A worker died or failed (not a user error, not a requested stop): the group can be restarted.
    `in_user_code`: it raised in the user's own network, loss or optimizer."""

    def __init__(self, message: str, in_user_code: bool = False) -> None:
        super().__init__(message)
        self.in_user_code = in_user_code


MAIN_GUARD_EXIT = 5  # a spawned worker found the user's script calling fit as it was imported (api.fit)


def _spawn(plan: RunPlan, restarts: int) -> dict[str, Any]:
    cfg = plan.cfg
    plan = dataclasses.replace(plan, clock={**plan.clock, "launched": time.time()})  # this attempt's (restarts)
    port = free_port()
    prefork.warm_up()
    method = prefork.start_method()
    smp = mp.get_context(method)
    results = smp.SimpleQueue()
    workers = plan.hardware.workers
    heartbeats = smp.Array("d", [time.monotonic()] * workers, lock=False)
    steps = smp.Array("q", [(plan.resume or {}).get("step", 0)] * workers, lock=False)
    # The plan travels to the workers: its in-memory tensors through shared memory, a memory-mapped cache as
    # its path; loaded and checked once, here.
    if plan.resume is not None and method == "forkserver":
        plan = dataclasses.replace(plan, resume=prefork.Packed(plan.resume))
    # The environment and standard streams as they are now: a forked worker would otherwise have the
    # forkserver's, from its start.
    context = mp.start_processes(_worker, args=(workers, port, plan, restarts, heartbeats, steps, results,
                                                dict(os.environ),
                                                prefork.streams()),
                                 nprocs=workers, join=False, start_method=method)
    try:
        return _join(context, results, steps, cfg)
    finally:
        results.close()  # its pipes now, not at the garbage collector's leisure


def _join(context: Any, results: Any, steps: Any, cfg: TrainConfig) -> dict[str, Any]:
    """Wait for the workers; rank 0's summary, or the exception that says why the run ended."""
    from .oom import OomWatch

    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    watch = OomWatch()
    try:
        watch.note([p.pid for p in context.processes])
        while not context.join(timeout=0.5, grace_period=5):
            watch.note([p.pid for p in context.processes if p.is_alive()])
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        # What is known for sure comes first: a worker that said why it stopped (bad input, a NaN, a full disk),
        # then one the out-of-memory killer killed. The worker join() names may only have failed after them,
        # in a collective they had left.
        if (said := _report_in(results) or _out_of_memory(context.processes, e.error_index, watch, steps)):
            raise said from None
        if isinstance(e, mp.ProcessRaisedException):  # a bug or a crash, not bad input: show its traceback
            raise _crashed(e) from None
        if e.exit_code in (1, 2, 3, 130, 143):  # a worker's UserError (1: a failed write): its message was lost
            raise _unreported(e.exit_code, cfg) from None
        if e.exit_code == MAIN_GUARD_EXIT:
            raise UserError("the workers import your script again (processes are spawned), and it calls paratrain.fit "
                            'when imported: put the call under `if __name__ == "__main__":`') from None
        how = "stopped answering" if e.exit_code == TIMEOUT_EXIT else f"died ({e.msg})"
        raise WorkerFailed(f"worker {e.error_index} {how}") from None
    except (KeyboardInterrupt, _Terminated) as e:
        signum = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
        stop_processes(context.processes, signum)
        raise _report_in(results) or _unreported(128 + signum, cfg) from None
    finally:
        signal.signal(signal.SIGTERM, old_term)
    if results.empty():
        raise UserError("the workers finished without a summary; see the lines above", code=1)
    return results.get()


def _crashed(e: mp.ProcessRaisedException) -> WorkerFailed:
    from .own import user_frame_in_text

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


def _report_in(results: Any) -> UserError | None:
    """What a worker reported before it left (a UserError, or Stopped after a signal); None where none did."""
    while not results.empty():
        item = results.get()
        if isinstance(item, dict) and "error" in item:
            if item["stopped"]:
                return Stopped(item["error"], item["code"] - 128)
            return UserError(item["error"], code=item["code"])
    return None


def _unreported(code: int, cfg: TrainConfig) -> UserError:
    """What is known when a worker left with `code` without saying why (a frozen worker, killed)."""
    if code in (130, 143):
        return Stopped(f"stopped by {signal.Signals(code - 128).name}; a worker that did not stop within "
                       f"{STOP_WAIT_S} s was killed, so the last checkpoint in {cfg.out} may be older than the last "
                       f"step; continue with --resume {cfg.out}", code - 128)
    what = "stopped" if code == 1 else "stopped on bad input"
    return UserError(f"a worker {what} without saying why (exit {code}); see the lines above", code=code)


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


STOP_WAIT_S = 8  # workers finish their step and save; then they are killed (the promise is 10 s)


def stop_processes(processes: list, signum: int) -> None:
    """Ctrl-C or SIGTERM: pass the signal on (each worker stops after its step, saves, exits), then make
    sure every worker is gone, so no process outlives the run."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signum)
    deadline = time.monotonic() + STOP_WAIT_S
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
