"""`paratrain submit`: a Slurm batch script for a training, printed (--dry-run) or handed to sbatch.

The script starts one task per worker with srun (the tasks form the group themselves: env.py), asks Slurm for
the requeue signal ahead of the time limit, and lets Slurm requeue the job; the run's folder is fixed by the
job's id, so every start of the job carries the same run on (requeue.py).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .. import config as C
from ..errors import UserError
from .parser import Parser
from .train import add as add_train
from .train import resolve_config


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="run a training as a Slurm job (sbatch), requeued when pre-empted")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs on each node (a worker each)")
    p.add_argument("--ntasks-per-node", type=int, help="workers (tasks) on each node (default: --gpus-per-node, "
                   "or 1 on CPUs, where one process using every core trains fastest)")
    p.add_argument("--cpus-per-task", type=int, help="cores of each worker (required without GPUs)")
    p.add_argument("--time", help="the job's time limit (sbatch --time: MINUTES, HH:MM:SS, D-HH)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--account", help="sbatch --account")
    p.add_argument("--job-name", default="paratrain", help="sbatch --job-name")
    p.add_argument("--signal-seconds", type=int, default=120, help="how long before the time limit Slurm sends "
                   "the requeue signal (train's --requeue-signal, USR1 by default): the time to finish a step and "
                   "save a checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="train and its flags, as for `paratrain train`")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.command or args.command[0] != "train":
        raise UserError("paratrain submit takes the command to run after its own flags: paratrain submit --nodes 2 "
                        "--gpus-per-node 4 --time 4:00:00 train --dataset cifar10 ...")
    cfg, named = _train_config(args.command[1:])
    tasks = _check(args, cfg)
    script = batch_script(args, cfg, tasks, args.command[1:], Path.cwd())
    where = cfg.out if named else C.default_run_dir(cfg, "job{JOBID}")
    if args.dry_run:
        print(script, end="")
        print(f"# the run folder: {Path.cwd() / where}", file=sys.stderr)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError("sbatch is not on PATH: submit from a machine of the Slurm cluster (its login node), or "
                        "print the script with --dry-run and submit it there")
    done = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"sbatch refused the job: {done.stderr.strip() or f'exit {done.returncode}'}")
    job = done.stdout.strip().split(";")[0]
    print(f"paratrain: submitted job {job}: {args.nodes * tasks} worker(s); its run folder "
          f"{Path.cwd() / where.replace('{JOBID}', job)}; its output slurm-{job}.out; squeue -j {job} shows it")
    return 0


def _train_config(argv: list[str]) -> tuple[C.TrainConfig, bool]:
    """The training's configuration, resolved as `paratrain train` will (a bad flag fails here, not in the
    queue); whether it names its run folder (--out, --resume)."""
    parser = Parser(prog="paratrain")
    add_train(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    targs = parser.parse_args(["train", *argv])
    return resolve_config(targs), bool(targs.out or targs.resume)


def _check(args: argparse.Namespace, cfg: C.TrainConfig) -> int:
    """Tasks per node, after the checks a job would otherwise fail after waiting in the queue."""
    for name in ("nodes", "gpus_per_node", "ntasks_per_node", "cpus_per_task", "signal_seconds"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "gpus_per_node" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be at least {0 if name == 'gpus_per_node' else 1}")
    tasks = args.ntasks_per_node or args.gpus_per_node or 1
    if args.gpus_per_node and tasks > args.gpus_per_node:
        raise UserError(f"--ntasks-per-node {tasks} is more than --gpus-per-node {args.gpus_per_node}: each task "
                        "is one worker on one GPU")
    if not args.gpus_per_node and not args.cpus_per_task:
        raise UserError("a job without GPUs needs --cpus-per-task C: the cores each task's worker uses (Slurm "
                        "gives a task one core otherwise)")
    if cfg.devices != "auto" and int(cfg.devices) != args.nodes * tasks:
        raise UserError(f"train's --devices {cfg.devices} but the job has {args.nodes * tasks} task(s) "
                        f"(--nodes {args.nodes} x --ntasks-per-node {tasks}); leave out --devices")
    if cfg.accelerator == "gpu" and not args.gpus_per_node:
        raise UserError("train's --accelerator gpu needs GPUs in the job: add --gpus-per-node G")
    return tasks


def batch_script(args: argparse.Namespace, cfg: C.TrainConfig, tasks: int, argv: list[str], cwd: Path) -> str:
    """The sbatch script: the resources, the requeue signal ahead of the end, one srun of the training."""
    lines = ["#!/bin/bash",
             "# written by paratrain submit. srun starts a task per worker and they form one group. Slurm's "
             f"{cfg.requeue_signal},",
             f"# {args.signal_seconds} s before the time limit (or on pre-emption: scancel --signal="
             f"{cfg.requeue_signal} JOB), makes every task",
             "# save a checkpoint at the same step; rank 0 requeues the job, and its next start carries the run on.",
             f"#SBATCH --job-name={args.job_name}", f"#SBATCH --nodes={args.nodes}",
             f"#SBATCH --ntasks-per-node={tasks}"]
    lines += [f"#SBATCH --{flag}={value}" for flag, value in (
        ("gpus-per-node", args.gpus_per_node or None), ("cpus-per-task", args.cpus_per_task), ("time", args.time),
        ("partition", args.partition), ("account", args.account)) if value]
    lines += [f"#SBATCH --signal={cfg.requeue_signal}@{args.signal_seconds}", "#SBATCH --requeue",
              "#SBATCH --open-mode=append", f"#SBATCH --output={cwd / 'slurm-%j.out'}",
              f"cd {shlex.quote(str(cwd))}",
              # one task failing on bad input ends the others at once, not after --collective-timeout
              f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m paratrain train "
              + " ".join(shlex.quote(a) for a in argv)]
    return "\n".join(lines) + "\n"


__all__ = ["add", "batch_script", "run"]
