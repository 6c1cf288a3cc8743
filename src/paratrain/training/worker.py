"""One worker's life, the same under every launcher: join the group, carry on from the one checkpoint the
group agrees on (a fresh run finds none), train, leave the group. launch.py runs it in this process, in N
processes it starts, or as one of torchrun's ranks."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..checkpoint.manager import RunCheckpoints
from ..checkpoint.resume import resume_point
from ..features.precision import float32_math
from ..parallel import requeue
from ..parallel.runplan import RunPlan
from ..runtime import dist, proc
from ..runtime.interrupt import Stopped, StopRequest
from .trainer import Trainer


def work(rank: int, world_size: int, local_rank: int, local_port: int | None, plan: RunPlan,
         devices: list[str] | None, restarts: int = 0,
         on_step: Callable[[int], None] | None = None) -> dict[str, Any] | None:
    """This process as worker `rank` of `world_size`: tune it, join the group (through a loopback rendezvous
    at `local_port`, or the launcher's rendezvous), restore, train, leave. Returns rank 0's summary (None elsewhere).
    `devices`: every worker's device, for the summary; `restarts`: the launcher's count so far; `on_step(step)`:
    after each update."""
    cfg = plan.cfg
    entered = plan.clock.get("worker_entered", time.time())  # in-process: the launch, a moment ago
    proc.tune_malloc(memory_first=cfg.activation_checkpointing != "none")
    proc.set_threads(plan.hardware.threads_per_worker)
    ctx = dist.init(rank, world_size, plan.devices[local_rank], local_port, cfg.collective_timeout,
                    plan.env.init_method, cpu_collectives=cfg.cpu_offload)
    plan = dataclasses.replace(plan, clock={**plan.clock, "worker_entered": entered, "joined": time.time()})
    if ctx.device.type == "cuda":  # the summary's peak is this run's: not an earlier fit's or trial's in the process
        torch.cuda.reset_peak_memory_stats(ctx.device)
    try:
        # the one owner of the run's checkpoints/ in this worker, which reads and writes them (collective where
        # they are written in the background)
        checkpoints = RunCheckpoints(cfg.out, ctx, cfg.async_checkpoint)
        state, restarts = resume_point(ctx, cfg, checkpoints, plan.length.total_steps, restarts)
        if state is not None:
            if ctx.is_main and plan.env.in_group and not cfg.resume:  # a launcher's start found the run going on
                print(f"paratrain: carrying on from the checkpoint of step {state['step']} found in {cfg.out}",
                      file=sys.stderr, flush=True)
            plan = dataclasses.replace(plan, cfg=cfg.replace(resume=cfg.out))
        requeue_signal = plan.requeue_signal  # Slurm's warning before the job's end (None elsewhere)
        # --precision tf32's matrix products, for this run only (features/precision.py)
        with StopRequest(requeue_signal).installed() as stop, float32_math(cfg.precision):
            try:
                return Trainer(ctx, plan, state, checkpoints, stop=stop, devices=devices, restarts=restarts,
                               on_step=on_step).run()
            except Stopped as e:
                if requeue_signal is None or e.signum != requeue_signal:
                    raise
                ctx.barrier()  # rank 0's checkpoint is written
                # where the job is requeued, SIGTERM is ignored from here on (requeue.ask), past this handler too
                said = requeue.requeue(e, plan.env, cfg, ctx.is_main)
                ctx.barrier()  # and the requeue asked, before any task leaves
                raise said from None
    finally:
        dist.teardown(ctx)
