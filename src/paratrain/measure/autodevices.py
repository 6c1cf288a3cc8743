"""`--devices auto` on CPUs: measure, then choose between one process using every core and N processes of
fewer threads, for the run's own network at the run's batch (as cudnn's benchmark mode picks kernels).

Why measure: on one CPU, workers share the cores, the caches and the memory bandwidth, and they pay a gradient
all-reduce each step. Whether that pays depends on the network: LeNet-5 at batch 512 runs about as fast
either way on 2 cores, a ResNet-18 at batch 64 ran 2.6x slower on 2 workers than on one (45 MB of gradients
over gloo a step). No fixed rule gets both right.

How: a few steps of the plan itself (the same network, batch, precision, BatchNorm and data) on each layout,
through the launcher the run will use; the median step after a warm-up. One worker is measured first, in
this process. A layout of N workers is measured only where the run is long enough to repay it: even a
perfect N-fold speed-up saves at most (1 - 1/N) of the run, and its measurement (starting N processes and a
dozen steps) must cost under a fifth of that. The rates are kept per network, batch and machine in the
user's cache folder, so a second run chooses at no cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..config import TrainConfig
from ..core.outputs import write_atomic
from ..data.folder import user_cache
from ..parallel import launch, strategies
from ..parallel.runplan import RunPlan, with_hardware
from ..runtime.devices import MAX_AUTO_CPU_WORKERS, Hardware, cpu_model, usable_cores
from ..runtime.env import Environment
from ..training.worker import work

WARM_STEPS = 3  # the first steps allocate, fault pages in and fill caches: not timed
TIMED_STEPS = 8
PROBE_STEPS = WARM_STEPS + TIMED_STEPS + 2  # a probe's run: the warm-up, the timed steps, and room to stop
START_S = 2.0  # what starting N workers and their group costs before their first step (measured: 1-2 s)
REPAY = 5  # a layout is measured only if its best case saves this many times what measuring it costs
MARGIN = 1.05  # more workers must be this much faster: fewer processes start sooner and use less memory
SHORT = 4  # a run of fewer than this many probes' steps is not measured: one worker, started at once
FAR_BELOW = 0.67  # an explicit --devices N this far below one worker's rate is said so


def applies(cfg: TrainConfig, env: Environment, hardware: Hardware | None) -> bool:
    """Whether this run's workers are for auto to choose: `--devices auto` on CPUs, data parallel, started
    here, with neither the threads nor a per-worker batch given (either fixes a layout, or what one computes)."""
    on_cpu = cfg.accelerator == "cpu" or (cfg.accelerator == "auto" and torch.cuda.device_count() == 0)
    return (cfg.devices == "auto" and on_cpu and strategies.get(cfg.strategy).auto_devices and not env.in_group
            and hardware is None and cfg.threads_per_worker is None and cfg.batch_per_worker is None
            and not cfg.oversubscribe and usable_cores() > 1)


def cpu_workers(workers: int) -> Hardware:
    """`workers` CPU processes sharing the cores. cpu_workers(1), one process with every core a thread, is
    measured first, and is the plan's until the choice."""
    return Hardware("cpu", workers, max(1, usable_cores() // workers), "gloo")


def candidates(cores: int, batch: int) -> list[int]:
    """Worker counts beyond one, fewest first: powers of two and the core count, each of which the batch
    splits evenly over."""
    top = min(cores, MAX_AUTO_CPU_WORKERS)
    counts = {n for n in (2, 4, 8) if n <= top} | {top}
    return sorted(n for n in counts if n > 1 and batch % n == 0)


# ---- the cache of measured rates ----

# What does not change a step's cost: where the run goes, how long, what it learns at, what it logs.
NOT_COST = {"out", "resume", "overwrite", "quiet", "tensorboard", "log_every", "histogram_every", "checkpoint_every",
            "keep_checkpoints", "async_checkpoint", "epochs", "steps", "max_time", "early_stopping", "seed", "lr",
            "momentum", "beta1", "beta2", "weight_decay", "lr_schedule", "lr_decay_rate", "lr_decay_steps",
            "lr_decay_epochs", "lr_staircase", "warmup_steps", "label_smoothing", "max_restarts", "collective_timeout",
            "devices", "requeue_signal", "max_requeues",
            "data_dir", "download", "eval_batch_size", "eval_ema", "test_flip", "cache_dir"}


def cache_key(plan: RunPlan) -> str:
    """The network, the batch and what else sets a step's cost, and this machine."""
    what = {k: v for k, v in plan.cfg.to_dict().items() if k not in NOT_COST}
    what["images"] = list(plan.data.train[0].shape[1:])  # one example's input (an image's, or any tensor's)
    # what else shapes a step: the inputs' type (token ids), the outputs and targets, the loss of one's own
    what["data"] = [str(plan.data.train[0].dtype), plan.data.num_outputs, list(plan.data.target_shape)]
    what["network"] = (plan.parts.record or {}).get("model") if plan.parts is not None else None
    what["loss"] = (plan.parts.record or {}).get("loss") if plan.parts is not None else None
    what["machine"] = [cpu_model(), usable_cores(), torch.__version__, __version__]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_file() -> Path:
    """PARATRAIN_DEVICES_CACHE, else devices.json in the user's cache folder."""
    return Path(os.environ.get("PARATRAIN_DEVICES_CACHE") or user_cache() / "devices.json")


def cached_rates(key: str) -> dict[int, float]:
    try:
        entry = json.loads(cache_file().read_text()).get(key, {})
        return {int(n): float(r) for n, r in entry.get("rates", {}).items()}
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: measure again
        return {}


def remember(key: str, rates: dict[int, float]) -> None:
    """Add these rates to the cache (a failure to write it only costs a measurement next time)."""
    try:
        path = cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        entry = table.get(key, {})
        entry["rates"] = {**entry.get("rates", {}), **{str(n): round(r, 1) for n, r in rates.items()}}
        entry["at"] = time.strftime("%Y-%m-%d %H:%M")
        table[key] = entry
        write_atomic(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass


# ---- measuring ----

class _Measured(Exception):
    """Raised by every worker at the same step once the timed steps are done: the probe ends there."""


def probe(rank: int, world_size: int, local_rank: int, port: int | None, plan: RunPlan, devices: list[str] | None,
          restarts: int = 0, on_step: Callable[[int], None] | None = None) -> dict[str, Any] | None:
    """A launch target: train the plan's first steps and time them; rank 0 returns the step times."""
    marks: list[float] = []

    def mark(step: int) -> None:
        if on_step is not None:
            on_step(step)
        marks.append(time.perf_counter())
        if len(marks) > WARM_STEPS + TIMED_STEPS:  # every worker stops after the same step
            raise _Measured

    try:
        work(rank, world_size, local_rank, port, plan, devices, restarts, on_step=mark)
    except _Measured:
        pass
    steps = [b - a for a, b in zip(marks[WARM_STEPS:], marks[WARM_STEPS + 1:], strict=False)]
    return {"step_s": statistics.median(steps)} if rank == 0 and steps else None


def measure(plan: RunPlan, hardware: Hardware) -> float:
    """Examples a second of the plan's training on this layout."""
    scratch = Path(tempfile.mkdtemp(prefix="paratrain-devices-"))
    cfg = plan.cfg.replace(out=str(scratch), resume=None, steps=PROBE_STEPS, epochs=None, max_time=None, quiet=True,
                           tensorboard=False, log_every=10**9, checkpoint_every=0, early_stopping=None,
                           histogram_every=0, max_restarts=0, compile=False)
    try:
        trial = with_hardware(dataclasses.replace(plan, cfg=cfg, report=None), hardware)
        result = launch.run(trial, target=probe)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not result or "step_s" not in result:
        raise RuntimeError("the measurement of a layout returned no step times")
    return plan.cfg.batch_size / result["step_s"]


def _said(n: int) -> str:
    threads = cpu_workers(n).threads_per_worker
    return f"{n} worker{'s' if n > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"


def choose(plan: RunPlan, total_steps: int) -> tuple[RunPlan, dict[str, Any]]:
    """The plan on the layout that trains fastest here, and what was measured (for the summary and the
    one line the run prints)."""
    started = time.perf_counter()
    cores = usable_cores()
    key = cache_key(plan)
    known = cached_rates(key)
    rates = dict(known)
    if not known and total_steps < SHORT * PROBE_STEPS:
        return plan, {"workers": 1, "threads_per_worker": cores, "rates": {}, "cost_s": 0.0, "cached": False,
                      "key": key, "not_measured": {"workers": 2, "steps": total_steps}}
    if 1 not in rates:
        rates[1] = measure(plan, cpu_workers(1))
    run_s = total_steps * plan.cfg.batch_size / rates[1]
    if plan.cfg.max_time:
        run_s = min(run_s, plan.cfg.max_time)
    best, skipped = 1, None
    for n in candidates(cores, plan.cfg.batch_size):
        if n not in rates:
            cost = START_S + PROBE_STEPS * plan.cfg.batch_size / rates[1]
            if run_s * (1 - 1 / n) < REPAY * cost:
                skipped = n
                break
            rates[n] = measure(plan, cpu_workers(n))
        if rates[n] < rates[best] * MARGIN:
            break  # more processes only add all-reduces and contention from here
        best = n
    if best > 1 and 1 not in known:
        # measured again, now that nothing else starts: the first measurement ran as the forkserver imported
        # torch beside it (a disturbed 1-worker rate would choose workers that lose); the faster of the two
        rates[1] = max(rates[1], measure(plan, cpu_workers(1)))
        best = max((n for n in rates if rates[n] >= rates[1] * (MARGIN if n > 1 else 1)), key=rates.get)
    measured = {n: r for n, r in rates.items() if n not in known}
    if measured:
        remember(key, measured)
    chosen = cpu_workers(best)
    choice = {"workers": best, "threads_per_worker": chosen.threads_per_worker,
              "rates": {str(n): round(r, 1) for n, r in sorted(rates.items())},
              "cost_s": round(time.perf_counter() - started, 2), "cached": not measured, "key": key}
    if skipped is not None:
        choice["not_measured"] = {"workers": skipped, "run_s": round(run_s, 1)}
    return (plan if best == 1 else with_hardware(plan, chosen)), choice


def line(choice: dict[str, Any]) -> str:
    """The one line a run prints about the choice."""
    rates = {int(n): r for n, r in choice["rates"].items()}
    best = choice["workers"]
    others = ", ".join(f"{rates[n]:,.0f} on {_said(n)}" for n in sorted(rates) if n != best)
    said = f"paratrain: --devices auto: {_said(best)}"
    if best in rates:
        said += f", {rates[best]:,.0f} examples/s"
    if others:
        said += f" against {others}"
    if "not_measured" in choice:
        skip = choice["not_measured"]
        how_long = f"{skip['steps']} steps" if "steps" in skip else f"about {skip['run_s']:.0f} s"
        said += f"; {skip['workers']} workers not tried: a run of {how_long} would not repay starting them"
    if not rates:
        return said
    how = "from earlier measurements" if choice["cached"] else f"measured in {choice['cost_s']:.1f} s"
    return f"{said} ({how}; kept in {cache_file()})"


def far_below(plan: RunPlan, summary: dict[str, Any]) -> str | None:
    """After an explicit --devices N on CPUs: its rate against one worker's measured here before (cached), in
    one line, where N workers ran far slower; also records the run's own rate for later choices."""
    hw, rate = plan.hardware, summary.get("examples_per_sec")
    if hw.accelerator != "cpu" or not strategies.get(plan.cfg.strategy).auto_devices or plan.env.in_group or not rate:
        return None
    if summary.get("steps", 0) - (summary.get("resumed_from_step") or 0) < 2 * (WARM_STEPS + TIMED_STEPS):
        return None  # too few steps for a rate that means something
    key = cache_key(plan)
    if hw.threads_per_worker * hw.workers == usable_cores():  # a layout auto would consider
        remember(key, {hw.workers: rate})
    one = cached_rates(key).get(1)
    if hw.workers == 1 or one is None or rate >= FAR_BELOW * one:
        return None
    return (f"paratrain: note: {hw.workers} workers trained at {rate:,.0f} examples/s, {rate / one:.2f}x one worker's "
            f"{one:,.0f} measured here for this network and batch: --devices 1 is faster on this machine "
            "(--devices auto measures and chooses)")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
