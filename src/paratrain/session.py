"""The session that opens a run: from a resolved configuration to the workers and back, the same for
`paratrain train`, `paratrain.fit` and each search trial.

    run(cfg, load_data)
      env     the process environment, detected once (env.py): a local start, or one of torchrun's or srun's ranks
      folder  held for the run's life (rundir.held); fresh / overwrite / resume decided here
      checks  what can be checked before any worker starts, from config.yaml and the checkpoints' names
      plan    runplan.make: processes, devices, batch split, data, the user's code tried once
      files   config.yaml and parts.yaml (rank 0), after every check: bad input leaves the old run as it was
      launch  launch.run(plan): every worker carries on from the one checkpoint it finds (resume.py); a stop on
              Slurm's requeue signal requeues the job (worker.py, requeue.py)
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

from . import autodevices, clock, launch, runplan
from . import config as C
from .data import Splits
from .devices import Hardware
from .env import Environment, detect
from .errors import UserError, WriteFailed
from .resume import dataset_mismatch, model_mismatch
from .rundir import check_fresh, check_owned, clear_run, held, newest_step, step_checkpoints, weights_only, write_atomic
from .runlength import Length, check_not_past, run_length
from .runlog import write_summary
from .userparts import Parts


def run(cfg: C.TrainConfig, load_data: Callable[[], Splits], parts: Parts | None = None, *,
        hardware: Hardware | None = None, devices: tuple[str, ...] | None = None,
        report: Callable[[int, dict[str, float]], bool] | None = None, env: Environment | None = None,
        last_line: bool = True, words: Callable[[str], str] = str) -> dict[str, Any] | None:
    """Open the run's folder, plan the run, write its record, launch the workers; rank 0's summary (None on
    other ranks of a launcher's group). `hardware`, `devices`, `report`: as runplan.make takes them (a search
    trial's share of the pool and its pruner); `last_line`: print the result line (a search prints its own);
    `words`: a note in the caller's words (paratrain.fit's: fields, not flags)."""
    env = env or detect()
    marks = {"process_start": clock.process_start(), "train_called": time.time()}

    def read_data() -> Splits:
        started = time.time()
        try:
            return load_data()
        finally:
            marks["data_s"] = time.time() - started

    requeued = bool(env.slurm and env.slurm.restart_count and not env.in_group and not cfg.resume and
                    (Path(cfg.out) / "config.yaml").is_file())
    if requeued:  # Slurm started the requeued job again: carry the run on
        cfg = cfg.replace(resume=cfg.out, overwrite=False)
    fresh = not cfg.resume and not env.in_group  # torchrun's and srun's starts and restarts carry a run on
    if cfg.overwrite and env.in_group:
        raise UserError(f"--overwrite clears a run before a fresh start, and every {env.launcher} start (and restart) "
                        "carries on the run in --out: clear the folder before launching, or pass a new --out")
    out = Path(cfg.out)
    with held(out) if env.is_main else contextlib.nullcontext():  # rank 0 writes it (other nodes may not see it)
        if fresh:
            check_fresh(cfg.out, cfg.overwrite)
        if cfg.resume:  # config.yaml of the run carried on: its model and dataset, before any data is read
            _check_resumed(cfg)
        auto = autodevices.applies(cfg, env, hardware)  # measured below, on the plan's own network and data
        plan = runplan.make(cfg, read_data, parts, hardware=autodevices.layout(1) if auto else hardware,
                            devices=devices, report=report, env=env)
        length = run_length(plan.cfg, len(plan.data.train[1]))
        choice = None
        if auto:
            plan, choice = autodevices.choose(plan, length.total_steps)
            if not plan.cfg.quiet:
                autodevices.say(autodevices.line(choice))
        cfg, parts = plan.cfg, plan.parts
        done = None if fresh else newest_step(out)  # no checkpoint is read here: each worker reads its own
        if done is not None:  # before config.yaml says otherwise (each worker checks the checkpoint it reads)
            check_not_past(done, length.total_steps, cfg.out)
            _check_form(out, cfg.strategy)
        if env.is_main and fresh:  # last: any bad input above leaves the old run as it was
            clear_run(out)  # --overwrite's run, or the leftovers of one that never took a step
        # done with: a restart of this run (--max-restarts) carries it on, and its checkpoints must not ask again
        cfg = cfg.replace(overwrite=False)
        plan = dataclasses.replace(plan, cfg=cfg)
        if env.is_main:
            _write_record(cfg, parts, out)
            if requeued and done is not None:  # in the job's log, quiet or not, as a group's start says it (worker)
                print(f"paratrain: carrying on from the checkpoint of step {done} found in {cfg.out}",
                      file=sys.stderr, flush=True)
            if not cfg.quiet:
                _announce(plan, length, done if not requeued or done >= length.total_steps else None)
        marks["launched"] = time.time()
        summary = launch.run(dataclasses.replace(plan, clock=marks))
    if summary is not None and not env.in_group:  # the workers have left: how long that took
        summary["finish_s"]["shutdown"] = max(0.0, time.time() - summary["ended_at"])
        summary["devices_auto"] = choice
        if choice is None and (note := autodevices.far_below(plan, summary)) and not cfg.quiet:
            autodevices.say(words(note))
        try:
            write_summary(out, summary)
        except WriteFailed as e:  # the run is done and saved: only this last figure is not on disk
            print(f"paratrain: warning: {e.path} keeps the summary without the shutdown time ({e.cause.strerror})",
                  file=sys.stderr, flush=True)
    if summary is not None and last_line:  # also with --quiet, from the command line and from Python alike
        rate = summary["examples_per_sec"]  # None when no step was timed (a start that trained none, and no record)
        accuracy = summary["test_accuracy"]  # None where the task has no classes
        metrics = "".join(f"test_{k} {summary[f'test_{k}']:.4f}  " for k in summary.get("metrics") or ()
                          if summary.get(f"test_{k}") is not None)
        print((f"test_accuracy {accuracy:.4f}  " if accuracy is not None else "")
              + f"test_loss {summary['test_loss']:.4f}  {metrics}examples/sec {f'{rate:.0f}' if rate else '-'}  "
              f"train_time {summary['train_time_s']:.1f}s  steps {summary['steps']}  -> {cfg.out}", flush=True)
        if cfg.time_phases:
            print(clock.table(summary), flush=True)
    return summary


def _check_resumed(cfg: C.TrainConfig) -> None:
    """The run carried on must be of this model and dataset: config.yaml says (the workers check the
    checkpoint they read the same way, resume.check)."""
    if why := weights_only(cfg.resume):  # a search trial's weights: before any data is read or record written
        raise UserError(why)
    saved = C.load_yaml(Path(cfg.resume) / "config.yaml")
    for why in (model_mismatch(saved.get("model"), cfg), dataset_mismatch(saved.get("dataset"), cfg)):
        if why:
            raise UserError(why)


def _check_form(out: Path, strategy: str) -> None:
    """The newest checkpoint's form is one the strategy reads: every strategy reads a sharded folder (fsdp's,
    hsdp's, a pipeline's), fsdp and hsdp no whole-model file. A run is refused before its config.yaml would say
    another strategy."""
    sharded = step_checkpoints(out / "checkpoints")[-1][1].is_dir()
    if not sharded and strategy in C.SHARDED:
        raise UserError(f"the checkpoint in {out} holds one whole model, which --strategy {strategy} does not read "
                        "(it reads sharded checkpoints); carry it on with ddp, tower or pipeline (without --strategy: "
                        f"the one that wrote it), or start a new run under --strategy {strategy}")


def _write_record(cfg: C.TrainConfig, parts: Parts | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    check_owned(out)  # again: another user could have made it since check_writable
    C.save_yaml(cfg, out / "config.yaml")
    if parts is not None and parts.record:  # what config.yaml names "custom"
        write_atomic(out / "parts.yaml", "# the network, optimizer and loss of your own that ran\n"
                     + yaml.safe_dump(parts.record, sort_keys=False))


def _announce(plan: runplan.RunPlan, length: Length, done: int | None) -> None:
    cfg, parts = plan.cfg, plan.parts
    if done is not None and done >= length.total_steps:
        print(f"paratrain: the run in {cfg.out} has done all its {done} steps: it is evaluated "
              "again; pass --steps N (steps=N) with more steps to train it further", flush=True)
    elif done is not None and cfg.resume:
        print(f"paratrain: resuming {cfg.out} from its checkpoint of step {done}", flush=True)
    if cfg.warmup_steps >= length.total_steps:  # a recipe's warm-up kept over fewer --epochs, say
        print(f"paratrain: note: --warmup-steps {cfg.warmup_steps} is as long as the run's "
              f"{length.total_steps} steps, so the learning rate never reaches --lr {cfg.lr:g}; lower "
              "--warmup-steps", flush=True)
    name = (parts.record or {}).get("model", cfg.model) if parts is not None else cfg.model
    hw = plan.hardware
    mesh = plan.layout.get("mesh")  # fsdp's shards (hsdp: copies x shards)
    how = "" if cfg.strategy == "ddp" else f" ({cfg.strategy}" + (
        f": {' copies x '.join(map(str, mesh))} shards" if mesh and len(mesh) == 2 else
        f": each holds 1/{mesh[0]} of the model" if mesh else "") + ")"
    print(f"paratrain: {name} on {cfg.dataset}, {hw.workers} {hw.accelerator} worker(s) x "
          f"{hw.threads_per_worker} thread(s){how}, global batch {cfg.batch_size}, run dir {cfg.out}", flush=True)
