"""Process hygiene: what every worker process does to itself (threads, malloc, its name, its parent, its
network interface) and how it leaves. No torch at import: the command line uses `end_process`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn


def tune_malloc(memory_first: bool = False) -> None:
    """Keep freed activation buffers in the heap instead of returning them to the kernel; or, `memory_first`
    (a run that recomputes activations to save memory), give every buffer of 256 KiB or more back when freed.

    With glibc's defaults, every large batch-sized buffer is mmap'd and unmapped each step; at batch
    512 that cost 20-50% of CPU time in page faults on the build machine (DESIGN.md). mallopt does at
    run time what GLIBC_TUNABLES would do at start-up, so it also works in this very process. Kept in the
    heap, though, the buffers of different sizes fragment it: the gpt of --activation-checkpointing's test
    (depth 4, width 256, context 256, batch 32) added 0.71x the resident memory of the run without
    recomputation where its tensors' peak was 0.41x; memory first, the resident set follows the tensors.

    A user's own settings (GLIBC_TUNABLES' glibc.malloc.*, or glibc's MALLOC_*_ variables) are theirs: with any
    one set, none of the three below is (glibc's defaults stand for the others). A model split between CPU
    workers to fit their memory asks for them: on 4 fsdp workers of the gpt of 151.6M weights
    (benchmarks/sharded_build.py), kept in the heap, each worker's peak added 0.52x one device's, and with
    MALLOC_MMAP_THRESHOLD_=262144 (in every run, one device's too) 0.30x, the tensors' own, for steps that took
    32-43% longer (2 fsdp workers of a gpt of width 1024 and 256, medians of 3 interleaved).
    """
    if not sys.platform.startswith("linux") or user_malloc():
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    if memory_first:  # a fixed threshold: glibc's own would rise to the size of every buffer freed
        libc.mallopt(M_MMAP_THRESHOLD, 256 * 2**10)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 2**10)
        libc.mallopt(M_TOP_PAD, 128 * 2**10)  # glibc's default (the other branch may have run in this process)
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's ceiling for this knob on 64-bit
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    libc.mallopt(M_TOP_PAD, 256 * 2**20)


def user_malloc() -> str:
    """The user's own settings of glibc's malloc in the environment ('' for none), which paratrain leaves as set."""
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    return " ".join(tunables + sorted(f"{k}={v}" for k, v in os.environ.items()
                                      if k.startswith("MALLOC_") and k.endswith("_")))


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free port on 127.0.0.1 for the rendezvous of this machine's workers, kept for them while the block
    runs. A port found free and let go could be taken (by any bind to port 0, or a connection's own port) in
    the seconds before rank 0 binds it. A socket bound to it, not listening, keeps the kernel from handing it
    to anyone; bound with SO_REUSEADDR, as rank 0's store socket is (dist.loopback_store), it lets that one
    bind and listen."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def die_with_parent() -> None:
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


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # the loop issues one op at a time; spare threads only contend
    except RuntimeError:  # already set in this process (in-process runs, tests)
        pass


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
