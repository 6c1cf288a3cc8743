"""The `paratrain search` command: settings from the flags, the pool of trial workers, the outputs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from .. import config as C
from ..config import TrainConfig
from ..core.errors import UserError
from ..core.optional import installed
from ..core.outputs import check_writable
from ..core.urls import masked
from ..parallel import requeue
from ..parallel.strategies import checked
from ..runtime import prefork
from ..runtime.env import detect
from ..runtime.interrupt import came_early, signal_name
from ..tracking import search as tracking
from .objective import choose
from .objective import of_study as objective_of
from .pool import Warned, recorded, run_pool

# `paratrain train` options that a search sets itself (or that mean something else here); --strategy is
# defined by the search itself, to tell a parallelism from a sampler
NOT_TRAIN_FLAGS = {"strategy", "out", "resume", "overwrite", "devices", "threads_per_worker", "quiet", "tensorboard",
                   "seed"}


def add_flags(p: argparse.ArgumentParser) -> None:
    from . import study as studies

    p.add_argument("--space", required=True, help="a space YAML file, or mlp-mnist / cnn-mnist")
    p.add_argument("--sampler", default="genetic", help=f"{', '.join(studies.SAMPLERS)} (default: genetic)")
    p.add_argument("--strategy", help="each trial's parallelism, as in `paratrain train`: ddp, tower, pipeline, "
                                      "hybrid (default: ddp; a space may fix or search it)")
    p.add_argument("--pruner", default="none", help=f"{', '.join(studies.PRUNERS)}: stop unpromising trials by "
                                                   "their validation accuracy after each epoch (default: none)")
    p.add_argument("--population", type=int, default=20, help="genetic: networks per generation (default: 20)")
    p.add_argument("--generations", type=int, default=10, help="genetic: generations (default: 10)")
    p.add_argument("--mutation-prob", type=float, help="genetic: probability of mutating each parameter")
    p.add_argument("--crossover-prob", type=float, default=0.9, help="genetic: crossover probability (0.9)")
    p.add_argument("--trials", type=int, help="trials to run (tpe/random: default 20; grid: at most this many)")
    p.add_argument("--parallel", type=int, help="trials at once (default: one per GPU, or 2 on CPUs with 2+ cores)")
    p.add_argument("--devices-per-trial", type=int, help="devices (GPUs, or CPU worker processes) per trial "
                                                         "(default: 1; a pipeline's --stages)")
    p.add_argument("--epochs-per-trial", type=int, help="training epochs of each trial (the same as --epochs)")
    p.add_argument("--storage", help="Optuna storage URL (default: $PARATRAIN_STORAGE, else a SQLite file in "
                                     "--out); postgresql://... lets workers on several machines share the study")
    p.add_argument("--study", default="search", help="study name in the storage (default: search)")
    p.add_argument("--worker", action="store_true", help="join a study another `paratrain search` started")
    p.add_argument("--time-budget", type=float, help="seconds: start no trial after this much of the search's "
                                                     "wall time (the running ones finish); run it again to go on")
    p.add_argument("--keep-trial-checkpoints", default="best", metavar="{none,best,all}",
                   help="what a finished trial keeps: best (default): the best trial its checkpoints (it can be "
                        "carried on), the others their last weights only; all: every trial its checkpoints; "
                        "none: no trial a checkpoint")
    p.add_argument("--objective", help="the validation figure the search optimises: accuracy (maximised), loss "
                                       "(minimised), perplexity (a language model's, minimised), or a metric of "
                                       "--metric in its own direction (mae: minimised, r2, f1: maximised); "
                                       "default: accuracy where the targets are classes, else loss")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of every trial's training")
    p.add_argument("--out", required=True, help="output folder")


def check_sampler(sampler: str, strategy: str | None, samplers: tuple[str, ...]) -> None:
    """--sampler picks how trials are chosen; --strategy is each trial's parallelism (it once meant the
    sampler here)."""
    from ..config import STRATEGIES as NAMES  # noqa: N811
    if strategy is not None and strategy not in NAMES:
        if strategy in samplers:
            raise UserError(f"the search's sampler is --sampler {strategy}; --strategy is each trial's parallelism "
                            f"({', '.join(NAMES)})")
        raise UserError(f"unknown --strategy '{strategy}'; each trial's parallelism is one of: {', '.join(NAMES)}")
    if sampler not in samplers:
        raise UserError(f"unknown --sampler '{sampler}'; choose one of: {', '.join(samplers)}")


def run(args: argparse.Namespace, train_values: dict[str, Any]) -> int:
    """`paratrain search`: check the options, open the study, run the pool of trials (requeued in a Slurm job
    on its warning), tidy the trials' folders and report the best."""
    from . import keep

    sp, base, cfg = _configure(args, train_values)
    accelerator, gpus, parallel, threads = _pool_size(args, cfg)
    args.env = getattr(args, "env", None) or detect()  # the command line's, detected once
    # the pool's processes fork from it (search/pool.py): it imports torch while the study opens
    prefork.warm_up(requeue.signal_for(args.env, cfg), cfg.model)
    out = check_writable(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings, study, budget = _open_study(args, sp, base, cfg, out, parallel)
    if not args.worker:  # the search's own tracker run (--logger mlflow, wandb), its trials' parent
        tracking.open_parent(study, base, out, {"sampler": args.sampler, "trials": budget, "study": args.study,
                                                "objective": settings.objective.key, "pruner": args.pruner})
    devices = _say_start(args, settings, study, budget, (accelerator, gpus, parallel, threads))
    this_start, wall = _search(args, settings, sp, base, cfg, study, budget, (accelerator, parallel, threads))
    keep.tidy(study, out, settings.keep)  # as the search stands now (a trial another machine finished last)
    from . import study as studies

    done = studies.counts(study)[0]
    if args.time_budget and not args.worker and done < budget:
        print(f"search: the time budget of {args.time_budget:.0f} s is spent, {done} of {budget} trials done; run "
              "the same command again (with a new --time-budget, or none) to go on")
    if study.user_attrs.get("exhausted"):
        print(f"search: ended early: {study.user_attrs['exhausted']}; the space has no new points left to try")
    if args.worker:
        print(f"search worker: done after {this_start:.0f} s")
        return 0
    _report_best(study, base, out, (wall, this_start), devices, args.time_budget, settings)
    return 0


def _configure(args: argparse.Namespace, train_values: dict[str, Any]) -> tuple[Any, Any, TrainConfig]:
    """The space, the trials' base configuration and the resolved one, every option checked before any work."""
    from . import keep, space
    from . import study as studies

    sp = space.load(args.space)
    check_sampler(args.sampler, args.strategy, studies.SAMPLERS)
    if args.pruner not in studies.PRUNERS:
        raise UserError(f"unknown --pruner '{args.pruner}'; choose one of: {', '.join(studies.PRUNERS)}")
    if args.keep_trial_checkpoints not in keep.POLICIES:
        raise UserError(f"unknown --keep-trial-checkpoints '{args.keep_trial_checkpoints}'; choose one of: "
                        f"{', '.join(keep.POLICIES)}")
    if args.strategy is not None:
        train_values = {**train_values, "strategy": args.strategy}
    base, cfg = _base_config(args, train_values, sp)
    _check_numbers(args)
    args.devices_per_trial = _devices_per_trial(args.devices_per_trial, cfg, sp)
    return sp, base, cfg


def _open_study(args: argparse.Namespace, sp: Any, base: Any, cfg: TrainConfig, out: Path,
                parallel: int) -> tuple[Any, Any, int]:
    """The search's settings, its study (new, resumed, or joined by a --worker) and its budget of trials; the
    data read once, so that a missing or corrupt dataset fails here."""
    from ..components.inputs import load_for
    from . import study as studies

    settings = studies.Settings(args.sampler, args.population, args.generations, args.mutation_prob,
                                args.crossover_prob, args.trials, parallel, args.devices_per_trial,
                                _storage_url(args, out), args.study, str(out),
                                args.seed, args.worker, args.pruner, args.keep_trial_checkpoints)
    budget = settings.budget(sp)  # a grid that is not a product of choices fails here, before any work
    data = load_for(cfg)  # a missing or corrupt dataset fails here, once
    objective = choose(args.objective, cfg.metric, data.classification, data.sequence)
    settings = dataclasses.replace(settings, objective=objective)
    study = studies.open_study(settings, sp, base)
    if args.worker and args.objective is not None and objective_of(study).name != args.objective:
        raise UserError(f"study '{args.study}' optimises {objective_of(study).words}, not --objective "
                        f"{args.objective}: leave --objective out to join it")
    settings = dataclasses.replace(settings, objective=objective_of(study))  # a --worker's: the study's own
    if not args.worker and study.user_attrs.get("exhausted"):  # a resumed search tries again, with new seeds
        study.set_user_attr("exhausted", None)
    if not args.worker:  # a time budget counts from this start; a search run again without one has none
        study.set_user_attr("deadline", time.time() + args.time_budget if args.time_budget else None)
    if not args.worker and settings.storage.startswith("sqlite"):
        requeued = studies.requeue_abandoned(study)
        if requeued:
            print(f"search: {requeued} trial(s) left running by an interrupted search are queued again")
    return settings, study, budget


def _say_start(args: argparse.Namespace, settings: Any, study: Any, budget: int,
               pool: tuple[str, int, int, int]) -> dict[str, Any]:
    """What the search will do, in two lines; the devices each pool process gets."""
    from . import study as studies

    accelerator, gpus, parallel, threads = pool
    finished = studies.counts(study)[0]
    if args.sampler != "grid" and budget < settings.wanted():
        print(f"search: the space has {budget} distinct points; each is trained once, so {budget} trials, not "
              f"{settings.wanted()}")
    print(f"search: {args.sampler}, {budget} trials ({finished} already done), {parallel} at once x "
          f"{threads} thread(s){' on GPUs' if gpus else ''}; study '{args.study}' in {masked(settings.storage)}",
          flush=True)
    devices = device_plan(accelerator, parallel, args.devices_per_trial, threads)
    print(f"search: devices: {devices['described']}", flush=True)
    return devices


def _search(args: argparse.Namespace, settings: Any, sp: Any, base: Any, cfg: TrainConfig, study: Any, budget: int,
            pool: tuple[str, int, int]) -> tuple[float, float]:
    """Run the pool of trials; this start's seconds and the search's over every start."""
    from . import study as studies

    accelerator, parallel, threads = pool
    start, earlier = time.perf_counter(), study.user_attrs.get("wall_s") or 0.0
    env = args.env
    # in a Slurm job, its warning before the end stops the pool (its trials as on Ctrl-C: left to be tried again)
    # and requeues the job from here; the pool's processes leave the signal to this one
    warned = requeue.signal_for(env, cfg)
    processes: list[int] = []  # the pool's processes, as they start
    try:
        with recorded(warned) as came, recorded(signal.SIGTERM) as terminated:
            if came_early(warned):  # it came while the search started
                raise Warned
            run_pool(settings, sp, base, parallel, threads, accelerator, study, budget, warned, processes, came,
                     terminated)
    except Warned:  # the pool has stopped: its trials are queued again now, for whichever worker comes first
        studies.requeue_abandoned(study, {f"{socket.gethostname()}:{pid}" for pid in processes})
        raise requeue.ask(env, cfg.max_requeues, warned, f"stopped by {signal_name(warned)}: the trials that were "
                          "running stopped, to be tried again", env.is_main,
                          again="sbatch the same script again to go on with the search",
                          next_start="the same command goes on with the search") from None
    finally:  # also when stopped (Ctrl-C, a signal): a search run again goes on, its wall time every start's
        this_start = time.perf_counter() - start
        if not args.worker:
            study.set_user_attr("wall_s", earlier + this_start)
    return this_start, earlier + this_start


def _report_best(study: Any, base: Any, out: Path, times: tuple[float, float], devices: dict[str, Any],
                 time_budget: float | None, settings: Any) -> None:
    """The search's files (best.yaml, trials.csv, leaderboard, plots) and its last lines."""
    from . import report

    wall, this_start = times
    result = report.write(study, base, out, wall, devices, time_budget)
    tracking.close_parent(base, out, result.get("best_value"), [out / name for name in REPORT_FILES])
    if result.get("best_trial") is None:
        raise UserError("no trial finished; see the errors in trials.csv", code=1)
    print(result["leaderboard"])
    print(f"search: best {settings.objective.words} {result['best_value']:.4g} (trial {result['best_trial']}); "
          f"its test {settings.objective.name} {float(result['best_test_value'] or 'nan'):.4g}; "
          f"{_trainings(result)} in {wall:.0f} s"
          f"{f' ({this_start:.0f} s in this start)' if wall > this_start else ''}; best.yaml, "
          f"trials.csv, leaderboard.md, summary.yaml{', fitness.png' if installed('matplotlib') else ''}"
          f"{'' if result['no_importance'] else ', importance.png'} in {out}")
    if result["no_importance"]:
        print(f"search: {result['no_importance']}")
    print(f"search: trial folders in {out / 'trials'}: {KEPT[settings.keep]}")


REPORT_FILES = ("best.yaml", "trials.csv", "leaderboard.md", "summary.yaml", "fitness.png", "importance.png")


def _trainings(result: dict[str, Any]) -> str:
    """What the budget bought: trainings, and how they ended (a pruned trial is a training cut short)."""
    parts = [f"{result['complete']} to the end", f"{result['pruned']} pruned"]
    parts += [f"{result['failed']} failed"] if result["failed"] else []
    more = [f"{result['reused']} proposals reused a finished trial's value"] if result["reused"] else []
    more += [f"{result['redrawn']} repeated a point in training and were drawn again"] if result["redrawn"] else []
    trained = result["complete"] + result["pruned"] + result["failed"]
    return f"{trained} trainings ({', '.join(parts)}{'; ' if more else ''}{'; '.join(more)})"


KEPT = {"all": "each keeps its checkpoints (carry one on with paratrain train --resume TRIAL)",
        "best": "the best keeps its checkpoints (paratrain train --resume TRIAL carries it on), the others their "
                "last weights (paratrain eval TRIAL)",
        "none": "no checkpoints kept (--keep-trial-checkpoints best or all keeps them)"}


def _storage_url(args: argparse.Namespace, out: Any) -> str:
    """--storage, else $PARATRAIN_STORAGE (a URL with a password need not be in the command line, which
    every user of the machine sees through `ps`), else a SQLite file in --out."""
    return args.storage or os.environ.get("PARATRAIN_STORAGE") or f"sqlite:///{out.resolve() / 'study.db'}"


def _base_config(args: argparse.Namespace, train_values: dict[str, Any], sp: Any) -> tuple[dict[str, Any], Any]:
    """Every trial's fixed options (the space's, then the flags'), and their validated configuration."""
    if args.epochs_per_trial is not None:
        if "epochs" in train_values and train_values["epochs"] != args.epochs_per_trial:
            raise UserError("give --epochs-per-trial or --epochs, not both")
        train_values = {**train_values, "epochs": args.epochs_per_trial}
    searched = sorted(set(train_values) & {p.name for p in sp.params})
    if searched:
        raise UserError(f"--{searched[0].replace('_', '-')} is a searched parameter of {args.space}; drop the flag")
    base = {**sp.fixed, **train_values, "seed": args.seed}
    cfg = checked(C.validate(C.from_dict(base)))
    if cfg.val_size == 0:
        raise UserError("a search needs a validation set (its fitness); drop --val-size 0")
    return base, cfg


def device_plan(accelerator: str, parallel: int, per_trial: int, threads: int) -> dict[str, Any]:
    """Which devices each of the pool's processes gives its trials (disjoint GPU sets), for the start line
    and summary.yaml."""
    from ..runtime.devices import Hardware
    from .runner import trial_devices

    slots = [list(trial_devices(Hardware(accelerator, per_trial, threads, ""), i)) for i in range(parallel)]
    if accelerator == "gpu":
        described = "; ".join(f"trials of process {i}: {','.join(d)}" for i, d in enumerate(slots))
    else:
        described = f"{parallel} trial(s) at once, each on {per_trial} CPU worker(s) x {threads} thread(s)"
    return {"accelerator": accelerator, "trials_at_once": parallel, "devices_per_trial": per_trial,
            "threads_per_worker": threads, "slots": slots, "described": described}


def _devices_per_trial(given: int | None, cfg: Any, sp: Any) -> int:
    """--devices-per-trial, or the fewest the layout runs on (a pipeline's stages); checked against a fixed
    strategy once, here, instead of failing every trial alike."""
    from ..parallel import strategies

    searched = {p.name for p in sp.params}
    devices = given or (strategies.get(cfg.strategy).least_devices(cfg) if "stages" not in searched else 1)
    if not searched & {"strategy", "stages"}:
        strategies.get(cfg.strategy).copies(cfg, devices)  # a UserError that names the flag to change
    return devices


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("population", "generations", "trials", "parallel", "devices_per_trial"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UserError(f"--time-budget must be a number of seconds above 0, not {args.time_budget}")
    for name in ("mutation_prob", "crossover_prob"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be a probability in [0, 1], not {value}")


def _pool_size(args: argparse.Namespace, cfg: Any) -> tuple[str, int, int, int]:
    """(accelerator, GPUs, trials at once, threads per process): never more processes x threads than cores."""
    import torch

    from ..runtime.devices import usable_cores

    gpus = torch.cuda.device_count() if cfg.accelerator in ("auto", "gpu") else 0
    cores = usable_cores()
    parallel = args.parallel or (max(1, gpus // args.devices_per_trial) if gpus else min(2, cores))
    if gpus and parallel * args.devices_per_trial > gpus:
        raise UserError(f"{parallel} trials x {args.devices_per_trial} GPUs exceed the {gpus} GPUs here; "
                        "lower --parallel or --devices-per-trial")
    workers = 1 if gpus else args.devices_per_trial  # CPU processes per trial
    if not gpus and parallel * workers > cores and not cfg.oversubscribe:
        raise UserError(f"{parallel} trials x {workers} workers exceed the {cores} cores here (they would "
                        f"oversubscribe them); use --parallel {max(1, cores // workers)} (or --oversubscribe, "
                        "slow but it runs, for tests)")
    return "gpu" if gpus else "cpu", gpus, parallel, max(1, cores // (parallel * workers))
