"""Slurm's pre-emption and time limits: a run stopped by the job's requeue signal (after every worker
checkpointed at the same step) asks Slurm, once, from rank 0, to requeue the job; Slurm starts it again with
SLURM_RESTART_COUNT one higher, and the same command carries the run on from that checkpoint (session.py).

What Lightning's users met (the signal caught by NCCL, `scontrol` missing in a container) is one line each here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .config import TrainConfig
from .env import Environment
from .interrupt import Stopped, signal_name, signal_number
from .rundir import newest_step

SCONTROL_TIMEOUT_S = 60.0


def applies(stopped: Stopped, env: Environment, cfg: TrainConfig) -> bool:
    """This stop is Slurm's warning before the end of a job (not Ctrl-C, not scancel's SIGTERM)."""
    return env.slurm is not None and stopped.signum == signal_number(cfg.requeue_signal)


def requeue(stopped: Stopped, env: Environment, cfg: TrainConfig) -> Stopped:
    """Requeue the job (rank 0 only; once per stop) and say what happens next; the Stopped to leave with."""
    job = env.slurm
    assert job is not None
    step = newest_step(Path(cfg.out))
    saved = f"stopped by {signal_name(stopped.signum)} at step {step} (checkpointed in {cfg.out})"
    again = ("sbatch the same script again (or run the same command with --resume "
             f"{cfg.out}) to carry the run on from that step")
    if job.restart_count >= cfg.max_requeues:
        return Stopped(f"{saved}; job {job.job_id} was requeued {job.restart_count} time(s) already "
                       f"(--max-requeues {cfg.max_requeues}), so it is not requeued again; {again}", stopped.signum)
    if not env.is_main:  # rank 0 asks, once for the job
        return Stopped(f"{saved}; rank 0 requeues job {job.job_id}", stopped.signum)
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return Stopped(f"{saved}; scontrol is not on PATH here (a container without Slurm's commands?), so job "
                       f"{job.job_id} was not requeued: add Slurm's client commands (scontrol, with its "
                       f"slurm.conf and munge socket) to the job's environment, or {again}", stopped.signum)
    try:
        done = subprocess.run([scontrol, "requeue", job.job_id], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
        why = done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else \
            (f"exit {done.returncode}" if done.returncode else "")
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why:
        return Stopped(f"{saved}; scontrol requeue {job.job_id} failed ({why}; the cluster may not allow "
                       f"requeueing: JobRequeue, or sbatch --requeue); {again}", stopped.signum)
    return Stopped(f"{saved}; job {job.job_id} requeued (requeue {job.restart_count + 1} of at most "
                   f"{cfg.max_requeues}): when Slurm starts it again, the same command carries the run on from "
                   "that checkpoint", stopped.signum)
