"""`paratrain submit`: a Slurm batch script for a training or a search, printed (--dry-run) or handed to sbatch.

A training's script starts one task per worker with srun (the tasks form the group themselves: env.py); a
search's starts the search (its pool of trials on the node), and with --array N a job array whose tasks share
one study (task 0 starts it, the others join it with --worker). Each asks Slurm for the requeue signal ahead of
the time limit and lets Slurm requeue the job: a training's folder is fixed by the job's id, so every start of
the job carries the same run on (requeue.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import config as C
from ..core.errors import UserError
from .parser import Parser
from .search import add as add_search
from .train import add as add_train
from .train import resolve_config

USAGE = ("paratrain submit takes the command to run after its own flags: paratrain submit --nodes 2 "
         "--gpus-per-node 4 --time 4:00:00 train --dataset cifar10 ... (or search ...)")


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="run a training or a search as a Slurm job (sbatch), requeued when pre-empted")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (a training's)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs on each node (a worker each)")
    p.add_argument("--ntasks-per-node", type=int, help="workers (tasks) on each node (default: --gpus-per-node, "
                   "or 1 on CPUs, where one process using every core trains fastest)")
    p.add_argument("--cpus-per-task", type=int, help="cores of each worker (required without GPUs)")
    p.add_argument("--array", type=int, help="search: this many tasks of a job array share one study (PostgreSQL)")
    p.add_argument("--time", help="the job's time limit (sbatch --time: MINUTES, HH:MM:SS, D-HH)")
    p.add_argument("--partition", help="sbatch --partition")
    p.add_argument("--account", help="sbatch --account")
    p.add_argument("--job-name", default="paratrain", help="sbatch --job-name")
    p.add_argument("--signal-seconds", type=int, default=120, help="how long before the time limit Slurm sends "
                   "the requeue signal (--requeue-signal, USR1 by default): the time to finish a step and save a "
                   "checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="train or search and its flags, as for `paratrain "
                                                             "train` or `paratrain search`")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class Work:
    """What the job runs: the command, its flags, its folder (with {JOBID} where the job's id names it)."""

    command: str
    argv: list[str]
    folder: str
    requeue_signal: str
    devices: str = "auto"
    accelerator: str = "auto"
    storage: str | None = None


MAX_SIGNAL_S = 65535  # sbatch --signal=SIG@TIME takes at most this

# submit's own flags, refused after the command (where argparse would call them the command's unknown flags)
OWN_FLAGS = ("--dry-run", "--array", "--nodes", "--gpus-per-node", "--ntasks-per-node", "--cpus-per-task", "--time",
             "--partition", "--account", "--job-name", "--signal-seconds")


def run(args: argparse.Namespace) -> int:
    if not args.command:
        raise UserError(USAGE)
    if args.command[0] not in ("train", "search"):
        raise UserError(f"paratrain submit runs train or search, not {args.command[0]!r}: {USAGE}")
    if misplaced := [a for a in args.command[1:] if a.split("=")[0] in OWN_FLAGS]:
        raise UserError(f"{misplaced[0].split('=')[0]} is paratrain submit's own: put it before "
                        f"{args.command[0]} (paratrain submit {misplaced[0]} ... {args.command[0]} ...)")
    work = _work(args.command[0], args.command[1:])
    tasks = _check(args, work)
    script = batch_script(args, work, tasks, Path.cwd())
    if args.dry_run:
        print(script, end="")
        print(f"# the {'run' if work.command == 'train' else 'search'} folder: {Path.cwd() / work.folder}",
              file=sys.stderr)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError("sbatch is not on PATH: submit from a machine of the Slurm cluster (its login node), or "
                        "print the script with --dry-run and submit it there")
    done = subprocess.run([sbatch, "--parsable"], input=script, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"sbatch refused the job: {done.stderr.strip() or f'exit {done.returncode}'}")
    if done.stderr.strip():  # sbatch's warnings (a limit it lowered, say)
        print(done.stderr.strip(), file=sys.stderr)
    job = done.stdout.strip().split(";")[0]
    folder = Path.cwd() / work.folder.replace("{JOBID}", job)
    if work.command == "train":
        print(f"paratrain: submitted job {job}: {args.nodes * tasks} worker(s); its run folder {folder}; its output "
              f"slurm-{job}.out; squeue -j {job} shows it")
    else:
        array = f" ({args.array} array tasks sharing one study; task 0's folder)" if args.array else ""
        print(f"paratrain: submitted job {job}: a search; its folder {folder}{array}; its output "
              f"slurm-{job}{'_*' if args.array else ''}.out; squeue -j {job} shows it")
    return 0


def _work(command: str, argv: list[str]) -> Work:
    """The command's flags, checked as `paratrain train` / `search` will (a bad flag fails here, not in the
    queue)."""
    parser = Parser(prog="paratrain")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train(sub)
    add_search(sub)
    parsed = parser.parse_args([command, *argv])
    if command == "search":
        return _search_work(parsed, argv)
    cfg = resolve_config(parsed)
    named = parsed.out or parsed.resume or (parsed.config and C.load_yaml(parsed.config).get("out"))
    folder = cfg.out if named else C.default_run_dir(cfg, C.job_tag("{JOBID}", None))  # the script's one srun
    return Work(command, argv, folder, cfg.requeue_signal, cfg.devices, cfg.accelerator)


def _search_work(parsed: argparse.Namespace, argv: list[str]) -> Work:
    """A search's flags, checked as far as they can be away from the cluster: its space and sampler."""
    from urllib.parse import urlsplit

    from ..search import command, space, study

    space.load(parsed.space)
    command.check_sampler(parsed.sampler, parsed.strategy, study.SAMPLERS)
    if parsed.worker:
        raise UserError("leave out --worker: in a job array task 0 starts the study and the other tasks join it")
    if parsed.storage and urlsplit(parsed.storage).password:
        raise UserError("--storage holds a password, which the job script would keep in plain text: export "
                        "PARATRAIN_STORAGE=postgresql://USER:PASSWORD@HOST/DB instead (sbatch hands your environment "
                        "to the job) and leave out --storage")
    storage = parsed.storage or os.environ.get("PARATRAIN_STORAGE")
    return Work("search", argv, parsed.out, parsed.requeue_signal or C.TrainConfig.requeue_signal,
                accelerator=parsed.accelerator or "auto", storage=storage)


def _check(args: argparse.Namespace, work: Work) -> int:
    """Tasks per node, after the checks a job would otherwise fail after waiting in the queue."""
    for name in ("nodes", "gpus_per_node", "ntasks_per_node", "cpus_per_task", "signal_seconds", "array"):
        value, least = getattr(args, name), 0 if name == "gpus_per_node" else 1
        if value is not None and value < least:
            raise UserError(f"--{name.replace('_', '-')} must be at least {least}")
    if args.signal_seconds > MAX_SIGNAL_S:
        raise UserError(f"--signal-seconds is at most {MAX_SIGNAL_S} (Slurm's limit)")
    if not args.gpus_per_node and not args.cpus_per_task:
        raise UserError("a job without GPUs needs --cpus-per-task C: the cores each task's worker uses (Slurm "
                        "gives a task one core otherwise)")
    if work.accelerator == "gpu" and not args.gpus_per_node:
        raise UserError(f"{work.command}'s --accelerator gpu needs GPUs in the job: add --gpus-per-node G")
    if work.command == "search":
        if args.nodes != 1 or (args.ntasks_per_node or 1) != 1:
            raise UserError("a search runs its trials on one node (--parallel, --devices-per-trial): leave out "
                            "--nodes and --ntasks-per-node, and give --array N for N nodes' worth of searching")
        if args.array and (work.storage or "").startswith("postgres://"):
            raise UserError("the search's storage URL starts postgres://: write postgresql:// (SQLAlchemy's name)")
        if args.array and not (work.storage or "").startswith("postgresql"):
            raise UserError("the tasks of a job array share one study: give the search --storage postgresql://... "
                            "(or PARATRAIN_STORAGE); a SQLite file on a network file system is unsafe: its locks "
                            "do not hold there")
        return 1
    if args.array:
        raise UserError("--array is for a search (its tasks share one study); a training spans nodes with --nodes")
    tasks = args.ntasks_per_node or args.gpus_per_node or 1
    if args.gpus_per_node and tasks > args.gpus_per_node:
        raise UserError(f"--ntasks-per-node {tasks} is more than --gpus-per-node {args.gpus_per_node}: each task "
                        "is one worker on one GPU")
    if work.devices != "auto" and int(work.devices) != args.nodes * tasks:
        raise UserError(f"train's --devices {work.devices} but the job has {args.nodes * tasks} task(s) "
                        f"(--nodes {args.nodes} x --ntasks-per-node {tasks}); leave out --devices")
    return tasks


def batch_script(args: argparse.Namespace, work: Work, tasks: int, cwd: Path) -> str:
    """The sbatch script: the resources, the requeue signal ahead of the end, one srun of the command."""
    what = ("srun starts a task per worker and they form one group" if work.command == "train" else
            "srun starts the search, which runs its trials on the node")
    lines = ["#!/bin/bash", f"# written by paratrain submit. {what}. Slurm's {work.requeue_signal},",
             f"# {args.signal_seconds} s before the time limit (or on pre-emption: scancel --signal="
             f"{work.requeue_signal} JOB), stops it",
             "# with its checkpoints saved; the job is requeued, and its next start goes on where it stopped.",
             f"#SBATCH --job-name={args.job_name}", f"#SBATCH --nodes={args.nodes}",
             f"#SBATCH --ntasks-per-node={tasks}"]
    lines += [f"#SBATCH --{flag}={value}" for flag, value in (
        ("gpus-per-node", args.gpus_per_node or None), ("cpus-per-task", args.cpus_per_task), ("time", args.time),
        ("partition", args.partition), ("account", args.account),
        ("array", f"0-{args.array - 1}" if args.array else None)) if value]
    log = "slurm-%A_%a.out" if args.array else "slurm-%j.out"
    lines += [f"#SBATCH --signal={work.requeue_signal}@{args.signal_seconds}", "#SBATCH --requeue",
              "#SBATCH --open-mode=append", f"#SBATCH --output={cwd / log}", f"cd {shlex.quote(str(cwd))}"]
    if args.cpus_per_task:  # since Slurm 22.05 srun does not take --cpus-per-task from the job: say it again
        lines.append("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK")
    # one task failing on bad input ends the others at once, not after --collective-timeout
    command = (f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m paratrain {work.command} "
               + " ".join(shlex.quote(a) for a in work.argv))
    if args.array:  # task 0 starts the study; the others join it, each with a folder of its own
        joins = f"{command} --worker --out {shlex.quote(work.folder)}-task\"$SLURM_ARRAY_TASK_ID\""
        lines += ['if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then', f"  {command}", "else", f"  {joins}", "fi"]
    else:
        lines.append(command)
    return "\n".join(lines) + "\n"
