"""`paratrain bench`: the same training in several device configurations, with plots (measure/bench.py runs it)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from .. import config as C
from ..core.errors import UserError
from ..core.outputs import check_writable
from ..parallel.strategies import checked
from .parser import add_train_flags, at_least_one

# What each configuration sets (its devices and parallelism), or the bench itself (where the runs go, their
# length and log); every other `paratrain train` option is the workload's, given as train takes it.
BENCH_SETS = {"devices", "accelerator", "threads_per_worker", "strategy", "stages", "microbatches", "out", "resume",
              "overwrite", "quiet", "tensorboard", "log_every", "time_phases", "epochs", "steps", "batch_size",
              "oversubscribe"}
DEFAULT_DATASET = "mnist"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure the same training in several device configurations, with plots")
    p.add_argument("--configs", help="e.g. cpu:1t,cpu:2t,ddp-cpu:2,gpu:1,gpu:2,tower-gpu:2 (default: a first look "
                   "at this machine: 11 rows on a node of 8 GPUs)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs per run (default: 2)")
    length.add_argument("--steps", type=int, help="steps per run instead")
    p.add_argument("--batch-size", type=int, help="global batch (default: the dataset's)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration (default: 2)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run configurations with more CPU workers than cores (marked in the report)")
    p.add_argument("--out", required=True, help="report directory")
    # the workload: any model (a network of yours, path/to/file.py:factory) and dataset (imagefolder with
    # --data-dir) that train takes, and its other options (--precision, --optimizer, ...)
    add_train_flags(p, skip=BENCH_SETS)
    p.set_defaults(run=run)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The options every configuration trains with: the train flags given, the dataset (default mnist)."""
    values = {name: getattr(args, name) for name in C.FIELDS
              if name not in BENCH_SETS and getattr(args, name, None) is not None}
    values.setdefault("dataset", DEFAULT_DATASET)
    if args.steps:
        values["steps"] = args.steps
    else:
        values["epochs"] = args.epochs or 2
    if args.batch_size:
        values["batch_size"] = args.batch_size
    if args.oversubscribe:
        values["oversubscribe"] = True
    return values


def as_flags(values: dict[str, Any]) -> list[str]:
    """`paratrain train` flags that set `values` (TrainConfig fields)."""
    flags = []
    for name, value in values.items():
        field = C.FIELDS[name]
        flag = field.metadata.get("flag", "--" + name.replace("_", "-"))
        if field.type == "bool":  # a switch sets the opposite of its default; the default needs no flag
            flags += [flag] if value != field.default else []
        else:
            flags += [flag, str(value)]
    return flags


def _refused(config: Any, values: dict[str, Any]) -> str | None:
    """Why the workload cannot run as `config` (the tower refuses --compile, a pipeline --accumulate, ...), checked
    as train would check it, before any process starts; None where it can."""
    from ..core.errors import UserError

    flags = dict(zip(config.flags[::2], config.flags[1::2], strict=True))
    own = {flag[2:].replace("-", "_"): value for flag, value in flags.items() if flag != "--accelerator"}
    try:
        checked(C.validate(C.from_dict({**values, **own})))
    except UserError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    from ..components.inputs import load_for
    from ..measure import bench, plot
    from ..parallel.requeue import signal_for
    from ..runtime import devices, prefork
    from ..tracking import bench as tracked

    at_least_one(args, "repeats", "epochs", "steps", "batch_size")
    check_writable(args.out)
    import torch

    configs = (bench.parse_configs(args.configs) if args.configs
               else bench.default_configs(devices.usable_cores(), torch.cuda.device_count()))
    values = workload(args)
    tracking = {k: values.pop(k) for k in tracked.TRACKING if k in values}  # sent once every run is measured
    C.validate(C.from_dict(tracking))  # a wrong --logger fails here, before any run
    cfg = checked(C.validate(C.from_dict({**values, "log_every": 20})))  # checked once, here
    C.check_read(cfg, values)
    # the runs fork from it (bench.Runner): it imports torch (and the model file's libraries) meanwhile
    prefork.warm_up(signal_for(args.env, cfg), cfg.model)
    load_for(cfg)  # a missing dataset fails here, once (and an image folder is decoded once, for every run)
    out = Path(args.out)
    report = bench.run_bench(configs, as_flags({**values, "log_every": 20}), args.repeats, out,
                             bench.Runner(train_run), refused=lambda config: _refused(config, values))
    failed = [r["name"] for r in report["results"] if r["status"] != "ok"]
    if len(failed) == len(configs):  # a bench that measured nothing did not do its work: no report, no success
        raise UserError(f"bench: 0 of {len(configs)} configurations measured (failed: {', '.join(failed)}); the "
                        f"reasons are above and in {out / 'results.json'}")
    path = plot.write_report(report, out)
    tracked.send(report, out, tracking, values)
    print(f"bench: {len(configs) - len(failed)} of {len(configs)} configurations measured"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''}; report: {path}")
    return 0


def train_run(argv: list[str], cwd: str, environ: dict[str, str], streams: Any) -> NoReturn:
    """A bench's run (measure/bench.Runner), forked from paratrain's forkserver: `paratrain ARGV` as if started
    afresh, in the bench's folder and environment (`streams`: its output files, adopted as the arguments were
    unpickled). It ends with the bench: a bench killed outright ends the forkserver, and with it this process."""
    import runpy
    import signal

    from ..runtime import prefork
    from ..runtime.env import detect
    from ..runtime.interrupt import hold, signal_number

    prefork.detach(environ)
    # In a Slurm job the forkserver keeps the job's warning blocked (prefork.shielded), and so would this run
    # and its launcher, which waits on it to give its saving workers time: as a fresh process, it takes it, and
    # keeps one that came meanwhile for the run (as the command line does from its start in a job)
    warnings = {signal_number(name) for name in C.REQUEUE_SIGNALS}
    with contextlib.suppress(UserError):  # a wrong Slurm variable: the command line says so in its line
        if detect().slurm is not None:
            hold(tuple(warnings))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, warnings)
    os.chdir(cwd)
    sys.argv = ["paratrain", *argv]
    runpy.run_module("paratrain", run_name="__main__", alter_sys=True)  # as `python -m paratrain ARGV`: it exits
    raise AssertionError("paratrain's command line returned")  # never reached: its entry leaves by os._exit
