"""The session that opens a run: from a resolved configuration to the workers and back, the same for
`paratrain train`, `paratrain.fit` and each search trial.

    run(cfg, load_data)
      env       the process environment, detected once at the entry and handed down (runtime/env.py)
      folder    held for the run's life (checkpoint/run_folder.held); fresh / overwrite / resume decided here
      _plan     what can be checked before any worker starts (config.yaml, the checkpoints listed once by
                checkpoint/manager.py), then parallel/runplan.make: processes, devices, batch split, data, the
                run's length, the user's code tried once; --devices auto's choice
      _open     config.yaml and parts.yaml (rank 0), after every check: bad input leaves the old run as it was
                (and where the workers refuse to carry a run on before it saves a step, its record is put back)
      launch    parallel/launch.run(plan, training.worker.work): every worker carries on from the one checkpoint
                it finds (checkpoint/resume.py); a stop on Slurm's requeue signal requeues the job
      _finish   the summary's last figures, and summary.json written (once)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import config as C
from .checkpoint.manager import Found, RunCheckpoints
from .checkpoint.resume import dataset_mismatch, model_mismatch, shape_mismatch
from .checkpoint.run_folder import check_fresh, clear_run, held, kept_after_failure
from .components.parts import Parts
from .config.length import check_not_past
from .core.errors import UserError, WriteFailed
from .core.outputs import check_owned, write_atomic
from .core.run_paths import RunPaths
from .data import Splits
from .measure import autodevices
from .parallel import launch, runplan, strategies
from .runtime import clock
from .runtime.devices import Hardware
from .runtime.env import Environment, detect
from .tracking.log import write_summary
from .training.worker import work


def run(cfg: C.TrainConfig, load_data: Callable[[], Splits], parts: Parts | None = None, *,
        hardware: Hardware | None = None, devices: tuple[str, ...] | None = None,
        report: Callable[[int, dict[str, float]], bool] | None = None, env: Environment | None = None,
        last_line: bool = True, words: Callable[[str], str] = str) -> dict[str, Any] | None:
    """Open the run's folder, plan the run, write its record, launch the workers; rank 0's summary (None on
    other ranks of a launcher's group). `cfg`: checked (parallel.strategies.checked, by the caller, once).
    `hardware`, `devices`, `report`: as runplan.make takes them (a search trial's share of the pool and its
    pruner); `env`: the caller's environment (detected here where not given);
    `last_line`: print the result line (a search prints its own); `words`: a note in the caller's words
    (paratrain.fit's: fields, not flags)."""
    env = env or detect()
    marks = {"process_start": clock.process_start(), "train_called": time.time()}
    cfg, requeued = _carried_on(cfg, env)
    fresh = not cfg.resume and not env.in_group  # torchrun's and srun's starts and restarts carry a run on
    out = Path(cfg.out)
    with held(out) if env.is_main else contextlib.nullcontext():  # rank 0 writes it (other nodes may not see it)
        plan, choice = _plan(cfg, _timed(load_data, marks), parts, env, fresh,
                             hardware=hardware, devices=devices, report=report)
        kept = _record_as_it_was(plan, fresh)
        _open(plan, fresh, requeued)
        marks["launched"] = time.time()
        try:
            summary = launch.run(dataclasses.replace(plan, clock=marks), work)
        except UserError:
            _put_back(kept, plan)
            raise
        if summary is not None and not env.in_group:  # this launcher finishes the summary, and writes it
            _finish(plan, summary, choice, words)
    if summary is not None and last_line:  # also with --quiet, from the command line and from Python alike
        _say_result(plan.cfg, summary)
    return summary


def _carried_on(cfg: C.TrainConfig, env: Environment) -> tuple[C.TrainConfig, bool]:
    """The configuration of this start, and whether it is a requeued Slurm job's start (which carries its run
    on: cfg.resume is set here, for it, and nowhere else in the launcher)."""
    if cfg.overwrite and env.in_group:
        raise UserError(f"--overwrite clears a run before a fresh start, and every {env.launcher} start (and restart) "
                        "carries on the run in --out: clear the folder before launching, or pass a new --out")
    requeued = bool(env.slurm and env.slurm.restart_count and not env.in_group and not cfg.resume and
                    RunPaths(cfg.out).config.is_file())
    return (cfg.replace(resume=cfg.out, overwrite=False) if requeued else cfg), requeued


def _timed(load_data: Callable[[], Splits], marks: dict[str, float]) -> Callable[[], Splits]:
    """`load_data`, its time kept in `marks` (the start-up figures of summary.json)."""
    def read_data() -> Splits:
        started = time.time()
        try:
            return load_data()
        finally:
            marks["data_s"] = time.time() - started

    return read_data


def _plan(cfg: C.TrainConfig, load_data: Callable[[], Splits], parts: Parts | None, env: Environment, fresh: bool,
          **chosen: Any) -> tuple[runplan.RunPlan, dict[str, Any] | None]:
    """Every check that can be made before a worker starts, then the plan (and `--devices auto`'s choice): the
    run folder's checkpoints listed once, here, and carried in the plan; none is opened (each worker reads its
    own)."""
    checkpoints = RunCheckpoints(cfg.out)
    if fresh:
        check_fresh(cfg.out, cfg.overwrite)
    if cfg.resume:  # config.yaml of the run carried on: its model and dataset, before any data is read
        _check_resumed(cfg, checkpoints)
    auto = autodevices.applies(cfg, env, chosen["hardware"])  # measured below, on the plan's own network and data
    if auto:
        chosen["hardware"] = autodevices.cpu_workers(1)
    plan = runplan.make(cfg, load_data, parts, env=env, **chosen)
    choice = None
    if auto:
        plan, choice = autodevices.choose(plan, plan.length.total_steps)
        if not plan.cfg.quiet:
            autodevices.say(autodevices.line(choice))
    found = Found() if fresh else checkpoints.found()
    if found.newest_step is not None:  # before config.yaml says otherwise (each worker checks what it reads)
        check_not_past(found.newest_step, plan.length.total_steps, cfg.out)
        checkpoints.check_form(plan.cfg.strategy, strategies.get(plan.cfg.strategy).reads_whole_files)
    # overwrite done with: a restart of this run (--max-restarts) carries it on, and must not clear it again
    return dataclasses.replace(plan, cfg=plan.cfg.replace(overwrite=False), checkpoints=found,
                               launcher_writes_summary=not env.in_group), choice


def _open(plan: runplan.RunPlan, fresh: bool, requeued: bool) -> None:
    """Rank 0 writes the run's record, after every check (bad input leaves the old run as it was), and says
    what starts."""
    cfg, out, done = plan.cfg, Path(plan.cfg.out), plan.checkpoints.newest_step
    if not plan.env.is_main:
        return
    if fresh:
        clear_run(out)  # --overwrite's run, or the leftovers of one that never took a step
    _write_record(cfg, plan.parts, out)
    if requeued and done is not None:  # in the job's log, quiet or not, as a group's start says it (worker)
        print(f"paratrain: carrying on from the checkpoint of step {done} found in {cfg.out}",
              file=sys.stderr, flush=True)
    if not cfg.quiet:
        _announce(plan, done if not requeued or (done is not None and done >= plan.length.total_steps) else None)


def _finish(plan: runplan.RunPlan, summary: dict[str, Any], choice: dict[str, Any] | None,
            words: Callable[[str], str]) -> None:
    """The workers have left: the summary's last figures (how long leaving took, auto's choice), and
    summary.json written, once, while the run folder is still held. A failed write is the run's error, as a
    failed write of the workers' is: one line naming the checkpoint kept and how to go on."""
    summary["finish_s"]["shutdown"] = max(0.0, time.time() - summary["ended_at"])
    summary["devices_auto"] = choice
    if choice is None and (note := autodevices.far_below(plan, summary)) and not plan.cfg.quiet:
        autodevices.say(words(note))
    out = Path(plan.cfg.out)
    try:
        write_summary(out, summary)
    except WriteFailed as e:  # a full disk, say
        raise WriteFailed(e.path, e.cause, kept_after_failure(out, e.remedy())) from None


def _say_result(cfg: C.TrainConfig, summary: dict[str, Any]) -> None:
    rate = summary["examples_per_sec"]  # None when no step was timed (a start that trained none, and no record)
    accuracy = summary["test_accuracy"]  # None where the task has no classes
    metrics = "".join(f"test_{k} {summary[f'test_{k}']:.4f}  " for k in summary.get("metrics") or ()
                      if summary.get(f"test_{k}") is not None)
    if summary.get("test_perplexity") is not None:  # a language model's
        metrics += f"test_perplexity {summary['test_perplexity']:.2f}  "
    tokens = summary.get("tokens_per_sec")
    speed = f"tokens/sec {tokens:.0f}" if tokens else f"examples/sec {f'{rate:.0f}' if rate else '-'}"
    print((f"test_accuracy {accuracy:.4f}  " if accuracy is not None else "")
          + f"test_loss {summary['test_loss']:.4f}  {metrics}{speed}  "
          f"train_time {summary['train_time_s']:.1f}s  steps {summary['steps']}  -> {cfg.out}", flush=True)
    if cfg.time_phases:
        print(clock.table(summary), flush=True)


def _check_resumed(cfg: C.TrainConfig, checkpoints: RunCheckpoints) -> None:
    """The run carried on must be of this model, dataset and model options: config.yaml says (the workers check
    the checkpoint they read the same way, resume.check and Strategy.load)."""
    if why := checkpoints.why_not_resumable():  # a search trial's weights: before any data is read or record written
        raise UserError(why)
    saved = C.load_yaml(RunPaths(cfg.resume).config)
    for why in (model_mismatch(saved.get("model"), cfg), dataset_mismatch(saved.get("dataset"), cfg),
                shape_mismatch(saved, cfg)):  # before config.yaml is rewritten with the options asked for
        if why:
            raise UserError(why)


def _record_as_it_was(plan: runplan.RunPlan, fresh: bool) -> dict[Path, str | None]:
    """The record of a run carried on (config.yaml, parts.yaml), as it was before this start rewrites it: put back
    where the workers refuse to carry the run on before it saved a step (no checkpoint of it loads)."""
    if fresh or not plan.cfg.resume or not plan.env.is_main:  # (a group's start of a new run has no record yet)
        return {}
    paths = RunPaths(plan.cfg.out)
    return {path: path.read_text() if path.is_file() else None for path in (paths.config, paths.parts)}


def _put_back(kept: dict[Path, str | None], plan: runplan.RunPlan) -> None:
    """The record as it was, where the run refused saved no newer step than it had: the options it was asked to
    carry on with never ran (bad input leaves the old run as it was)."""
    if not kept or RunCheckpoints(plan.cfg.out).found().newest_step != plan.checkpoints.newest_step:
        return
    for path, text in kept.items():
        if text is None:
            path.unlink(missing_ok=True)
        else:
            write_atomic(path, text)


def _write_record(cfg: C.TrainConfig, parts: Parts | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    check_owned(out)  # again: another user could have made it since check_writable
    C.save_yaml(cfg, RunPaths(out).config, strategies.unread_options(cfg))
    if parts is not None and parts.record:  # what config.yaml names "custom"
        write_atomic(RunPaths(out).parts, "# the network, optimizer and loss of your own that ran\n"
                     + yaml.safe_dump(parts.record, sort_keys=False))


def _announce(plan: runplan.RunPlan, done: int | None) -> None:
    cfg, parts, length = plan.cfg, plan.parts, plan.length
    if done is not None and done >= length.total_steps:
        print(f"paratrain: the run in {cfg.out} has done all its {done} steps: it is evaluated "
              "again; pass --steps N (steps=N) with more steps to train it further", flush=True)
    elif done is not None and cfg.resume:
        # listed, not opened: where that one proves damaged, a worker says which one it carries on from instead
        print(f"paratrain: resuming {cfg.out}, whose newest checkpoint is of step {done}", flush=True)
    if cfg.warmup_steps >= length.total_steps:  # a recipe's warm-up kept over fewer --epochs, say
        print(f"paratrain: note: --warmup-steps {cfg.warmup_steps} is as long as the run's "
              f"{length.total_steps} steps, so the learning rate never reaches --lr {cfg.lr:g}; lower "
              "--warmup-steps", flush=True)
    name = (parts.record or {}).get("model", cfg.model) if parts is not None else cfg.model
    hw = plan.hardware
    print(f"paratrain: {name} on {cfg.dataset}, {hw.workers} {hw.accelerator} worker(s) x "
          f"{hw.threads_per_worker} thread(s){plan.layout.describe()}, global batch {cfg.batch_size}, run dir "
          f"{cfg.out}", flush=True)
