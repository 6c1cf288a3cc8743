"""Slurm's pre-emption and time limits: a run stopped by the job's requeue signal (every worker at the same
step) asks Slurm, once, from rank 0, to requeue the job, while the group is still together (worker.py): the
others wait until rank 0's checkpoint is written and the requeue asked, as srun --kill-on-bad-exit would end
rank 0 as soon as another task left. Slurm starts the job again with SLURM_RESTART_COUNT one higher, and the
same command carries the run on from that checkpoint (session.py). A search does the same from its own process
once its trials have stopped (search/command.py).

What Lightning's users met (the signal caught by NCCL, `scontrol` missing in a container) is one line each here.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from ..checkpoint.run_folder import newest_step
from ..config import TrainConfig
from ..runtime.env import Environment
from ..runtime.interrupt import Stopped, signal_name, signal_number

SCONTROL_TIMEOUT_S = 60.0


def signal_for(env: Environment, cfg: TrainConfig) -> int | None:
    """The signal that stops a run to requeue it: Slurm's warning before a job's end (--requeue-signal), in a
    Slurm job; None elsewhere (Ctrl-C and SIGTERM stop, never requeue)."""
    return signal_number(cfg.requeue_signal) if env.slurm is not None else None


def requeue(stopped: Stopped, env: Environment, cfg: TrainConfig, is_main: bool) -> Stopped:
    """A training's stop: requeue the job (rank 0 only) and say what happens next; the Stopped to leave with."""
    saved = f"stopped by {signal_name(stopped.signum)} at step {newest_step(Path(cfg.out))} (checkpointed in {cfg.out})"
    return ask(env, cfg.max_requeues, stopped.signum, saved, is_main,
               # a new job (sbatch again) has a new id, so a folder named by the job's id would be a new run
               again=f"run the same command with --resume {cfg.out} (in a new job too: a job's run folder is named "
                     "by its id) to carry the run on from that step",
               next_start="the same command carries the run on from that checkpoint")


def ask(env: Environment, max_requeues: int, signum: int, saved: str, is_main: bool, again: str,
        next_start: str) -> Stopped:
    """Requeue the job once (rank 0 only), unless it was requeued `max_requeues` times already; `saved`: what
    was kept, `again`: how to go on by hand, `next_start`: what the job's next start does."""
    job = env.slurm
    assert job is not None
    if job.restart_count >= max_requeues:
        return Stopped(f"{saved}; job {job.name} was requeued {job.restart_count} time(s) already "
                       f"(--max-requeues {max_requeues}), so it is not requeued again; {again}", signum)
    if not is_main:  # rank 0 asks, once for the job; Slurm's SIGTERM follows its requeue (see below)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return Stopped(f"{saved}; rank 0 requeues job {job.name}", signum)
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return Stopped(f"{saved}; scontrol is not on PATH here (a container without Slurm's commands?), so job "
                       f"{job.name} was not requeued: add Slurm's client commands (scontrol, with its "
                       f"slurm.conf and munge socket) to the job's environment, or {again}", signum)
    # Slurm ends a requeued job's steps with SIGTERM at once, maybe before scontrol returns: this process is
    # leaving, and must live to say why (a CI run lost rank 0's line to it). Ignored from here on, also past a
    # stop handler's end (interrupt.restore); where the job is not requeued, SIGTERM ends the process again.
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        done = subprocess.run([scontrol, "requeue", job.name], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
        why = done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else \
            (f"exit {done.returncode}" if done.returncode else "")
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why:  # not requeued: no SIGTERM follows from it, and one (the time limit's) ends this process again
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)
        return Stopped(f"{saved}; scontrol requeue {job.name} failed ({why}; the cluster may not allow "
                       f"requeueing: JobRequeue, or sbatch --requeue); {again}", signum)
    return Stopped(f"{saved}; job {job.name} requeued (requeue {job.restart_count + 1} of at most "
                   f"{max_requeues}): when Slurm starts it again, {next_start}", signum)
