"""Collectives on the workers a run would start: an all-reduce sweep over message sizes with nccl-tests'
figures (time, algorithm bandwidth, bus bandwidth, wrong elements), broadcast and barrier times, and the
latency and bandwidth of the ring model that `paratrain plan` predicts with.

nccl-tests' definitions (doc/PERFORMANCE.md there): algbw = bytes / time; busbw = algbw x 2(N-1)/N for an
all-reduce, the figure that compares with the hardware's link bandwidth whatever N is.
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

SIZES = tuple(4 * 4**k for k in range(14))  # 4 B .. 256 MiB, as float32 elements x 4 bytes
MIN_REPEATS, MAX_REPEATS, TIME_PER_SIZE_S = 3, 20, 0.25
# Test-only faults, on the last rank: "wrong-sum" adds 1 to its share of the checked all-reduce; "hang"
# never joins the first collective (the others must fail after the timeout, never wait for ever).
FAULT_VARIABLE = "PARATRAIN_DOCTOR_FAULT"


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n


def _timed(op: Any, device: torch.device, repeats: int) -> float:
    """The median time of `op` (a collective, waited for)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def own_cap(device: torch.device, local_workers: int) -> int:
    """The largest message this worker can hold: 256 MiB, or a quarter of what is free for it (its buffer and
    the collective's own copies), measured on its own device only (a CUDA context on every GPU from every
    rank costs memory, and fails where GPUs are in exclusive mode)."""
    from ...runtime.devices import _memory_gib

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = (_memory_gib() or 4) * 2**30 / max(1, local_workers)
    return int(min(SIZES[-1], free / 4))


def sweep(rank: int, world_size: int, device: torch.device, budget_s: float, max_bytes: int,
          group: Any = None) -> dict[str, Any]:
    """The all-reduce sweep, broadcast and barrier, on `group` (every rank runs it). The sizes stop where the
    time budget (rank 0's clock) or the smallest worker's memory ends them, the same on every rank."""
    fault = os.environ.get(FAULT_VARIABLE) if rank == world_size - 1 else None
    if fault == "hang":
        time.sleep(3600)
    cap = torch.tensor([float(max_bytes)], device=device)
    dist.all_reduce(cap, op=dist.ReduceOp.MIN, group=group)
    rows, start = [], time.perf_counter()
    expected = world_size * (world_size + 1) / 2  # each rank contributes rank + 1
    for nbytes in SIZES:
        go = torch.tensor([float(nbytes <= cap.item() and time.perf_counter() - start < budget_s)], device=device)
        dist.broadcast(go, 0, group=group)
        if not go.item():
            break
        buffer = torch.zeros(nbytes // 4, device=device)  # zeros stay zeros however often they are summed
        reduce = partial(dist.all_reduce, buffer, group=group)
        reduce()  # a warm-up: the first call of a size sets up its buffers
        once = _timed(reduce, device, 1)
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, TIME_PER_SIZE_S // max(once, 1e-9))))
        repeats = int(_agreed(repeats, device, group))
        seconds = _timed(reduce, device, repeats)
        buffer.fill_(rank + 1 + (fault == "wrong-sum"))
        reduce()
        wrong = torch.tensor([float((buffer != expected).sum().item())], device=device)
        dist.all_reduce(wrong, group=group)  # nccl-tests counts the wrong elements of every rank
        algbw = nbytes / seconds
        rows.append({"bytes": nbytes, "time_s": seconds, "algbw": algbw, "busbw": algbw * bus_factor(world_size),
                     "wrong": int(wrong.item()), "repeats": repeats})
    payload = torch.zeros(2**20, device=device)  # 4 MiB
    dist.broadcast(payload, 0, group=group)
    broadcast_s = _timed(partial(dist.broadcast, payload, 0, group=group), device, 10)
    barrier_s = _timed(partial(dist.barrier, group=group), device, 20)
    return {"rows": rows, "broadcast_bytes": 4 * 2**20, "broadcast_s": broadcast_s, "barrier_s": barrier_s,
            "fit": fit(rows, world_size)}


def _agreed(value: float, device: torch.device, group: Any) -> float:
    """Rank 0's value on every rank (the repeats of a size must match, or the group would deadlock)."""
    t = torch.tensor([float(value)], device=device)
    dist.broadcast(t, 0, group=group)
    return t.item()


def fit(rows: list[dict[str, Any]], n: int) -> dict[str, float] | None:
    """The ring model's bandwidth and latency (plan.ring_allreduce_s: t = 2(N-1)/N x bytes / bandwidth +
    2(N-1) x latency): the latency from the small messages (up to 4 KB, where it is all there is), the
    bandwidth from the slope over the large ones (1 MB and up). One least-squares line over every size let
    the noise of a few small messages on a busy host set the latency (it gave 0.9 ms on 2 CPU cores)."""
    small = [r for r in rows if r["bytes"] <= 4096]
    large = [r for r in rows if r["bytes"] >= 2**20]
    if n < 2 or not small or len(large) < 2:
        return None
    slope, _ = statistics.linear_regression([bus_factor(n) * r["bytes"] for r in large], [r["time_s"] for r in large])
    if slope <= 0:
        return None
    fixed = statistics.median(r["time_s"] - bus_factor(n) * r["bytes"] * slope for r in small)
    return {"bandwidth": 1.0 / slope, "latency": max(fixed, 0.0) / (2 * (n - 1))}


def timed_group(timeout_s: float) -> Any:
    """A group of every rank whose collectives fail after `timeout_s`: the process group itself is joined
    with a longer timeout (starting processes and NCCL's set-up on a busy host take longer than a collective
    should). With NCCL, a timed-out wait raises (blocking wait) instead of the watchdog aborting the process."""
    import datetime

    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))


JOIN_TIMEOUT_S = 120.0


def prepare_nccl() -> None:
    """Before joining: NCCL's timeouts raise in the waiting call, which the doctor reports as a failed check."""
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")


def spawned(rank: int, world_size: int, port: int, devices: list[str], budget_s: float, timeout_s: float,
            threads: int, queue: Any) -> None:
    """A worker of the sweep started by the doctor on this machine: its result or its error goes to queue."""
    from ...runtime.dist import init, teardown
    from ...runtime.proc import die_with_parent, on_loopback

    die_with_parent()  # a doctor that is killed takes its workers with it
    torch.set_num_threads(threads)
    on_loopback()
    prepare_nccl()
    try:
        ctx = init(rank, world_size, devices[rank], port, max(timeout_s, JOIN_TIMEOUT_S))
        try:
            group = timed_group(timeout_s)
            result = sweep(rank, world_size, ctx.device, budget_s, own_cap(ctx.device, world_size), group)
        finally:
            teardown(ctx)
        queue.put((rank, "ok", result if rank == 0 else None))
    except Exception as e:  # noqa: BLE001 (a collective that failed or timed out: the check's result)
        queue.put((rank, "error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"))
