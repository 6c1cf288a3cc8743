"""`paratrain doctor`: does multi-device training work here, and how fast are the links?

    inventory     versions, GPUs, peer access, cores, what --devices auto picks (every node under torchrun)
    collectives   an all-reduce sweep over message sizes on the workers a run would start (nccl-tests'
                  figures and its check of every element), broadcast and barrier; the fitted link for
                  `paratrain plan --link FILE`
    equivalence   10 steps on 1 device and on N, per strategy, compared weight by weight

Each check ends ok, slow (a warning) or failed, with what to do; a hung collective fails after a timeout.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue as queues
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...core.errors import UserError

SWEEP_BUDGET_S = 10.0  # the all-reduce sweep stops at the first size past this time
LINK_FILE = "link.json"


@dataclass
class Check:
    name: str
    status: str  # "ok", "slow", "failed"
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f": {self.fix}" if self.fix and self.status != "ok" else ""
        return f"{self.status:<7}{self.name}: {self.detail}{fix}"


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def sweep_here(accelerator: str, workers: int, threads: int, timeout_s: float) -> tuple[dict | None, str | None]:
    """The sweep on `workers` spawned processes of this machine: (rank 0's result, None) or (None, why)."""
    from ...parallel.launch import stop_processes
    from ...runtime.devices import Hardware, device_map
    from ...runtime.proc import reserved_port
    from .collectives import JOIN_TIMEOUT_S, spawned

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    devices = list(device_map(Hardware(accelerator, workers, threads, "")))
    with reserved_port() as port:  # held until the workers are done with it
        processes = [spawn.Process(target=spawned, args=(rank, workers, port, devices, SWEEP_BUDGET_S, timeout_s,
                                                          threads, results), daemon=True) for rank in range(workers)]
        for p in processes:
            p.start()
        started = time.monotonic()
        deadline = started + JOIN_TIMEOUT_S + SWEEP_BUDGET_S + 2 * timeout_s  # joining, the sweep, a timed-out call
        found: dict[int, tuple[str, Any]] = {}
        try:
            while len(found) < workers and time.monotonic() < deadline:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queues.Empty:
                    for rank, p in enumerate(processes):  # a worker that died without a word (killed, crashed)
                        if rank not in found and p.exitcode not in (None, 0):
                            found[rank] = ("error", f"its process ended with exit code {p.exitcode}")
                            deadline = min(deadline, time.monotonic() + 5)
                    continue
                found[rank] = (status, value)
                if status == "error":  # the others fail too, or wait on the one that failed: a little grace
                    deadline = min(deadline, time.monotonic() + 5)
        finally:
            stop_processes([p for p in processes if p.is_alive()], signal.SIGKILL)
    errors = [f"worker {r}: {v}" for r, (s, v) in sorted(found.items()) if s == "error"]
    if errors:
        return None, "; ".join(errors[:2])
    if len(found) < workers:
        missing = sorted(set(range(workers)) - set(found))
        return None, (f"worker(s) {', '.join(map(str, missing))} gave no result within "
                      f"{time.monotonic() - started:.0f} s (a hung collective)")
    return found[0][1], None


def collective_checks(result: dict | None, error: str | None, backend: str, workers: int,
                      gpu_link: dict | None) -> list[Check]:
    where = f"{workers} {backend} workers"
    fix = ("set NCCL_P2P_DISABLE=1 and run again; if that passes, the GPUs' direct link is at fault"
           if backend == "nccl" else "see the error; on several machines, set GLOO_SOCKET_IFNAME to the interface "
           "that joins them")
    if error is not None:
        between = f"between GPU 0 and {workers - 1}" if backend == "nccl" else f"between the {where}"
        return [Check("all-reduce", "failed", f"{backend.upper() if backend == 'nccl' else backend} all-reduce "
                      f"failed {between}: {error}", fix)]
    assert result is not None
    rows = result["rows"]
    wrong = [r for r in rows if r["wrong"]]
    if wrong:
        return [Check("all-reduce", "failed", f"{sum(r['wrong'] for r in wrong)} wrong elements on {where} (first "
                      f"at {_size(wrong[0]['bytes'])})", fix)]
    big = rows[-1]
    at = next((r for r in rows if r["bytes"] == 64 * 2**20), big)
    fitted = result["fit"]
    detail = (f"{_size(rows[0]['bytes'])} .. {_size(big['bytes'])} on {where}, every element right; bus bandwidth "
              f"{at['busbw'] / 1e9:.2f} GB/s at {_size(at['bytes'])}")
    if fitted:
        detail += f"; fitted {fitted['bandwidth'] / 1e9:.2f} GB/s, {fitted['latency'] * 1e6:.1f} us a message"
    checks = [Check("all-reduce", "ok", detail)]
    if gpu_link and big["busbw"] < gpu_link["peak_busbw"] / 2:
        checks[0] = Check("all-reduce", "slow", detail + f", below half of {gpu_link['kind']}'s "
                          f"{gpu_link['peak_busbw'] / 1e9:.0f} GB/s", "check `nvidia-smi topo -m` and that "
                          "NCCL_P2P_DISABLE is not set")
    checks.append(Check("broadcast, barrier", "ok", f"broadcast of {_size(result['broadcast_bytes'])} "
                        f"{result['broadcast_s'] * 1e3:.2f} ms, barrier {result['barrier_s'] * 1e6:.0f} us"))
    return checks


def partition_check(nodes: list[dict[str, Any]]) -> Check:
    """How long torchrun's agent on a node cut off from the rendezvous host outlives its workers (see
    paratrain.partition), against --collective-timeout's default."""
    from ...config import TrainConfig
    from ...runtime.tcp_timeout import fitting, give_up_s

    timeout = TrainConfig.collective_timeout
    advised = fitting(timeout)
    known = [(n["node"], n["tcp_retries2"]) for n in nodes if n.get("tcp_retries2") is not None]
    late = [(node, r) for node, r in known if r > advised]
    if not late:
        most = max((give_up_s(r) for _, r in known), default=None)
        after = f", after at least {most:.0f} s" if most is not None else " (its setting cannot be read)"
        return Check("partition", "ok", f"torchrun's agent on a node cut off from the rendezvous host ends when TCP "
                     f"gives up{after}")
    said = ", ".join(f"{r} on node {node} (at least {give_up_s(r):.0f} s)" for node, r in late)
    return Check("partition", "slow", f"torchrun's agent on a node cut off from the rendezvous host waits until TCP "
                 f"gives up, long after --collective-timeout's default {timeout:g} s: net.ipv4.tcp_retries2 = "
                 f"{said}", f"run `sysctl -w net.ipv4.tcp_retries2={advised}` on each node (at least "
                 f"{give_up_s(advised):.0f} s, just past the timeout; a lower value also ends other connections "
                 "sooner on a flaky link)")


def equivalence_checks(results: list[dict[str, Any]]) -> list[Check]:
    from .equivalence import BOUND

    checks = []
    for r in results:
        name = f"1 vs {r['devices']} devices, {r['strategy']}" + (f", {r['task']}" if r.get("task", "images") !=
                                                                   "images" else "")
        if "error" in r:
            task = " --dataset tokens --model gru" if r.get("task") == "token ids" else ""
            checks.append(Check(name, "failed", r["error"], "run the same with `paratrain train --strategy "
                                f"{r['strategy']} --devices {r['devices']}{task}` to see it whole"))
        else:
            checks.append(Check(name, "ok" if r["ok"] else "failed", f"largest weight difference "
                                f"{r['max_abs_diff']:.1e} after {r['steps']} steps (bound {BOUND:g})",
                                "training on several devices does not equal one here: report it with the "
                                "output of `paratrain doctor --json`"))
    return checks


def examine(devices: str = "auto", timeout_s: float = 60.0, train: bool = True) -> dict[str, Any]:
    """Every check on this machine, with the workers `--devices` would start; a dict for --json."""
    from ...runtime import devices as D
    from .equivalence import check
    from .inventory import inventory

    info = inventory()
    plan = D.resolve("auto", devices, None)
    report: dict[str, Any] = {"nodes": [info], "devices": asdict(plan), "collectives": None, "equivalence": []}
    checks: list[Check] = []
    if plan.workers < 2:
        checks.append(Check("devices", "ok", f"one {plan.accelerator} device: no collective or 1-vs-N check to run "
                            "(give --devices 2 or more on a machine with them)"))
    else:
        result, error = sweep_here(plan.accelerator, plan.workers, plan.threads_per_worker, timeout_s)
        report["collectives"] = result if result is not None else {"error": error}
        checks += collective_checks(result, error, plan.backend, plan.workers, info["gpu_link"])
        if train:
            cores = plan.workers * plan.threads_per_worker if plan.accelerator == "cpu" else plan.threads_per_worker
            report["equivalence"] = check(plan.accelerator, plan.workers, cores)
            checks += equivalence_checks(report["equivalence"])
    if plan.accelerator == "cpu":
        checks.append(matmul_check(report, plan.workers * plan.threads_per_worker))
    report["checks"] = [asdict(c) for c in checks]
    report["passed"] = all(c.status != "failed" for c in checks)
    return report


def matmul_check(report: dict[str, Any], cores: int) -> Check:
    """This CPU's float32 matrix-multiply rate on 1 thread and on every core: the peak a run's model FLOPs
    utilisation (summary.json's mfu) is measured against, kept in the user's cache for the runs to read."""
    from ...runtime.peaks import measure_cpu

    rates = {threads: measure_cpu(threads) for threads in sorted({1, cores})}
    report["matmul_flops_per_sec"] = {str(t): r for t, r in rates.items()}
    shown = ", ".join(f"{r / 1e9:.0f} GFLOP/s on {t} thread{'s' if t > 1 else ''}" for t, r in rates.items())
    return Check("matmul", "ok", f"float32 matrix multiply: {shown} (the peak of a language model's mfu on this "
                 "CPU)", "")


def examine_group(timeout_s: float = 60.0) -> dict[str, Any]:
    """Every rank of torchrun's group: each node's inventory, the sweep across the group (across nodes: the
    link between them). The 1-vs-N training check runs without torchrun, on one node."""
    import dataclasses

    from ...runtime.devices import for_group, group_devices
    from ...runtime.dist import init, teardown
    from ...runtime.env import detect
    from .collectives import JOIN_TIMEOUT_S, prepare_nccl
    from .inventory import inventory

    env = detect()
    rank, world, local_rank = env.rank, env.world_size, env.local_rank
    info = inventory(env.node_rank)
    try:
        plan = for_group(env, "auto", None)
    except UserError as e:  # more tasks on a node than it has GPUs, say: the finding, from every rank
        checks = [Check(env.launcher, "failed", str(e))]
        return {"nodes": [info], "devices": None, "collectives": None, "equivalence": [], "rank": rank,
                "checks": [asdict(c) for c in checks], "passed": False}
    report: dict[str, Any] = {"nodes": [info], "devices": asdict(plan), "collectives": None, "equivalence": [],
                              "rank": rank}
    nodes = env.nodes
    if nodes > 1 and plan.backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME") and _loopback_host():
        checks = [Check("network", "failed", f"gloo picked the loopback interface ({socket.gethostname()} resolves "
                        "to 127.x), which other nodes cannot reach", "set GLOO_SOCKET_IFNAME to the interface that "
                        "joins the nodes (`ip -br addr` lists them) and run again")]
        return {**report, "checks": [asdict(c) for c in checks], "passed": False}
    devices = group_devices(env, plan)
    prepare_nccl()
    try:
        ctx = init(rank, world, devices[local_rank], None, max(timeout_s, JOIN_TIMEOUT_S), env.init_method)
    except Exception as e:  # noqa: BLE001 (the rendezvous or the backend's set-up failed: the finding)
        checks = [Check("network", "failed", f"rank {rank} could not join the group: {type(e).__name__}: "
                        f"{' '.join(str(e).split())[:300]}", "check MASTER_ADDR and that every node reaches it; set "
                        "GLOO_SOCKET_IFNAME (gloo) or NCCL_SOCKET_IFNAME (NCCL) to the interface that joins the "
                        "nodes")]
        return {**report, "checks": [asdict(c) for c in checks], "passed": False}
    try:
        report["nodes"], result, error = _gather_and_sweep(ctx, env, info, timeout_s)
    finally:
        teardown(ctx)
    report["collectives"] = result if result is not None else {"error": error}
    where = f"across {len(report['nodes'])} node(s)"
    checks = collective_checks(result, error, plan.backend, world, info["gpu_link"] if nodes == 1 else None)
    checks = [dataclasses.replace(c, detail=f"{c.detail} ({where})") for c in checks]
    if nodes > 1:
        checks.append(partition_check(report["nodes"]))
    if env.slurm is not None:
        report["slurm"] = {"job": env.slurm.name, "nodes": list(env.slurm.nodes), "tasks": world,
                           "tasks_here": env.local_world_size, "cpus_per_task": env.cpus_per_task,
                           "gpus_a_task_sees": len(info["gpus"])}
        checks.insert(0, slurm_check(env, plan, len(report["nodes"])))
    return {**report, "checks": [asdict(c) for c in checks], "passed": all(c.status != "failed" for c in checks)}


def _gather_and_sweep(ctx: Any, env: Any, info: dict[str, Any],
                      timeout_s: float) -> tuple[list[dict[str, Any]], Any, str | None]:
    """In the joined group: every node's inventory (one per node), then the collectives' sweep, or the error
    of a collective that failed or timed out."""
    import torch.distributed as dist

    from .collectives import own_cap, sweep, timed_group

    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, info)
    nodes = list({n["node"]: n for n in gathered}.values())
    try:
        group = timed_group(timeout_s)
        return nodes, sweep(env.rank, env.world_size, ctx.device, SWEEP_BUDGET_S,
                            own_cap(ctx.device, env.local_world_size), group), None
    except Exception as e:  # noqa: BLE001 (a collective that failed or timed out)
        return nodes, None, f"rank {env.rank}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"


def slurm_check(env: Any, plan: Any, nodes_joined: int) -> Check:
    """The job as Slurm sees it against what paratrain trains on it."""
    from ...runtime.devices import usable_cores

    job = env.slurm
    seen = (f"job {job.name}: {len(job.nodes)} node(s) ({', '.join(job.nodes)}), {env.world_size} task(s) "
            f"({env.local_world_size} on this node), {env.cpus_per_task or 'unset'} --cpus-per-task; paratrain "
            f"trains {plan.workers} {plan.accelerator} worker(s) x {plan.threads_per_worker} thread(s), "
            f"{nodes_joined} node(s) joined")
    if nodes_joined != env.nodes:
        return Check("slurm", "failed", seen, f"{env.nodes} node(s) should have joined: run `srun` with "
                     "--ntasks-per-node, or check each node's host name")
    if plan.accelerator == "cpu" and plan.threads_per_worker * env.local_world_size > usable_cores():
        return Check("slurm", "slow", seen, "the tasks' threads oversubscribe this node's cores: give the job "
                     "--cpus-per-task")
    return Check("slurm", "ok", seen)


def _loopback_host() -> bool:
    try:
        return socket.gethostbyname(socket.gethostname()).startswith("127.")
    except OSError:
        return True


def write_link(report: dict[str, Any], out: Path) -> Path | None:
    """The fitted link, for `paratrain plan --link FILE`."""
    fitted = (report.get("collectives") or {}).get("fit")
    if not fitted:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / LINK_FILE
    workers = report["devices"]["workers"]
    path.write_text(json.dumps({"name": f"measured by paratrain doctor on {socket.gethostname()} ({workers} "
                                        f"{report['devices']['backend']} workers)", **fitted}, indent=2) + "\n")
    return path


def read_link(path: str) -> tuple[str, float, float]:
    """A link file that `paratrain doctor --out` wrote: (name, bandwidth bytes/s, latency s)."""
    try:
        data = json.loads(Path(path).read_text())
        return data["name"], float(data["bandwidth"]), float(data["latency"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the link file {path} ({e}); write one with `paratrain doctor --out DIR`") from e
