"""`paratrain search`: an Optuna study whose trials are `paratrain train` runs on a pool of devices.

Optuna is the engine: its samplers choose the trials (GridSampler for brute force, NSGAIISampler for the
genetic algorithm, TPE, random) and its storage (a SQLite file, or PostgreSQL shared by many machines)
holds them, so an interrupted search resumes where it stopped. paratrain runs the trials: P worker
processes, each with cores / P threads (or a GPU each), each training in-process on a dataset it loaded
once. The fitness is a validation figure (--objective: the accuracy, the loss, or a metric); the test figures are
kept aside and reported for the winner.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .. import config as C
from ..core.errors import UserError
from ..runtime import prefork
from ..runtime.interrupt import Stopped
from . import keep
from .space import Space
from .study import Settings, TrialReport, counts, described, make_sampler, open_study, over_budget

# how long a pool process waits for the others to be ready before it takes trials alone (a machine so loaded
# that torch's import takes minutes)
READY_WAIT_S = 120


def worker(index: int, s: Settings, space: Space, base: dict[str, Any], threads: int, accelerator: str,
           ready: Any = None) -> None:
    """One process of the pool: load the data once, then run trials until the search has its budget. `ready`:
    the flags of the pool's first processes, which wait for each other once each has its data and study."""
    import optuna
    import torch

    from ..components.inputs import load_for
    from ..runtime.proc import tune_malloc

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(threads)
    tune_malloc()
    data = load_for(C.validate(C.from_dict(base)))
    study = open_study(s, space, base, index, pool=True)
    study.sampler = make_sampler(s, index, len(study.get_trials(deepcopy=False)))  # a resumed search draws anew
    objective = _Objective(s, space, base, study, data, (index, threads, accelerator))
    if ready is not None:
        wait_for_the_others(ready, index)
    while True:
        finished, running, waiting = counts(study)
        if (objective.grid and not waiting) or (not objective.grid and not waiting
                                                and finished + running >= objective.budget()):
            return
        if study.user_attrs.get("exhausted") or past_deadline(study):
            return
        if objective.redraws >= MAX_REDRAWS:
            study.set_user_attr("exhausted", f"the sampler proposed only points already trained, {MAX_REDRAWS} "
                                f"times in a row, after {finished} distinct trials")
            return
        objective.redraws += 1
        study.optimize(objective, n_trials=1)
        keep.tidy(study, s.out, s.keep)  # the trial just finished may be the new best, or not


class _Objective:
    """One pool process's objective for Optuna: a trial's point drawn, skipped where the search has no place for
    it, reused where trained already, else trained; its figures recorded on the trial."""

    def __init__(self, s: Settings, space: Space, base: dict[str, Any], study: Any, data: Any,
                 where: tuple[int, int, str]) -> None:
        self.s, self.space, self.base, self.study, self.data = s, space, base, study, data
        self.index, self.threads, self.accelerator = where  # the pool process, its threads, its devices' kind
        self.grid = described(study)["sampler"] == "grid"
        self.redraws = 0  # proposals in a row that repeated an earlier trial

    def budget(self) -> int:  # read afresh: the search run again with another --trials moves it under a worker
        return self.study.user_attrs["budget"]

    def __call__(self, trial: Any) -> float:
        import optuna

        if (self.grid and not trial.user_attrs.get("grid_point")) or \
                (not self.grid and over_budget(self.study, trial.number, self.budget())):
            # the queue ran dry under us (not a grid point), or another worker took the last place first
            trial.set_user_attr("unused", True)
            raise optuna.TrialPruned()
        params = self.space.suggest(trial)
        if not self.grid:  # a point queued again after its run was abandoned is new too: that run holds no point
            earlier = duplicate_of(self.study, trial.number, self.space, params)
            if earlier is not None:
                trial.set_user_attr("duplicate_of", earlier)
                value = finished_value(self.study, earlier)
                if value is not None:  # training is deterministic for a seed: the sampler gets the value
                    trial.set_user_attr("params", params)  # without a second training
                    trial.set_user_attr("reused", earlier)
                    return value
                raise optuna.TrialPruned()  # still training, or failed, or pruned: drawn again
            trial.set_user_attr("distinct", True)
        self.redraws = 0
        trial.set_user_attr("params", params)  # as trained (floats at the space's precision)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        summary = self._train(trial, params)
        try:
            value = float("nan") if summary is None else self._value(trial, summary)
        except optuna.TrialPruned:
            self._track(trial, params, "pruned")
            raise
        self._track(trial, params, "finished" if value == value else "failed", value)
        return value

    def _track(self, trial: Any, params: dict[str, Any], state: str, value: float | None = None) -> None:
        """The trial's child run in the search's trackers (--logger mlflow, wandb); never the search's end."""
        from ..tracking import search as tracking

        try:
            tracking.send_trial(self.study, self.base, Path(self.s.out) / "trials" / f"{trial.number:04d}",
                                trial.number, params, state, value, trial.user_attrs.get("error"))
        except Exception as e:  # noqa: BLE001 (the trackers' own failures are a warning already)
            print(f"paratrain: warning: trial {trial.number} was not sent to the trackers ({type(e).__name__}: "
                  f"{str(e)[:200]})", file=sys.stderr, flush=True)

    def _train(self, trial: Any, params: dict[str, Any]) -> dict[str, Any] | None:
        """The trial's training; None where this point failed (the reason on the trial), the search going on."""
        s = self.s
        cfg = C.validate(C.from_dict({**self.base, **params, "out": str(Path(s.out) / "trials" / f"{trial.number:04d}"),
                                      "quiet": True, "tensorboard": False, "logger": "none"}))
        report = TrialReport(s.storage, s.study, s.pruner, trial._trial_id, trial, s.objective.key) \
            if s.pruner != "none" else None
        try:
            return train_one(cfg, self.data, self.index, self.threads, self.accelerator, s.devices_per_trial, report)
        except Stopped:  # Ctrl-C or SIGTERM reached a data-parallel trial's workers: the search stops, the trial
            raise  # is left running and queued again on resume
        except UserError as e:  # a NaN loss, an impossible combination: this point fails, the search goes on
            trial.set_user_attr("error", str(e))
        except Exception as e:  # noqa: BLE001 (a CUDA out-of-memory error, a bug of a network): this point fails
            import traceback

            traceback.print_exc()
            trial.set_user_attr("error", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        return None

    def _value(self, trial: Any, summary: dict[str, Any]) -> float:
        """The trained trial's figures recorded, and its objective's value (NaN: this point failed)."""
        import optuna

        objective = self.s.objective
        for key in ("test_accuracy", "train_time_s", "val_loss", "examples_per_sec"):
            trial.set_user_attr(key, summary[key])
        trial.set_user_attr("test_value", summary.get(f"test_{objective.name}"))  # the objective's, on test
        if summary.get("pruned"):  # its curve stays in the study; a pruned trial is never the best
            trial.set_user_attr("pruned_at_epoch", summary["epochs_validated"])
            raise optuna.TrialPruned()
        value = summary.get(objective.key)
        if value is None:  # a NaN or infinite figure (the summary's None): this point failed, the search goes on
            trial.set_user_attr("error", f"its {objective.words} is not a number")
            return float("nan")
        return value


MAX_REDRAWS = 100


def past_deadline(study: Any) -> bool:
    """--time-budget: no trial starts after the deadline that the search's first process recorded in the
    study (a --worker on another machine keeps it too); trials running then finish."""
    deadline = study.user_attrs.get("deadline")
    return deadline is not None and time.time() >= deadline


def wait_for_the_others(ready: Any, index: int) -> None:
    """Say this pool process is ready (its flag, `index`), and wait until every first process is, or the search
    says go on (the last flag: one of them ended), or READY_WAIT_S has passed."""
    ready[index] = 1
    deadline = time.monotonic() + READY_WAIT_S
    while not (all(ready[:-1]) or ready[-1]) and time.monotonic() < deadline:
        time.sleep(0.05)


def finished_value(study: Any, number: int) -> float | None:
    """Trial `number`'s value where it completed (a proposal equal to it reuses it), else None."""
    from optuna.trial import TrialState

    earlier = study._storage.get_trial(study._storage.get_trial_id_from_study_id_trial_number(study._study_id,
                                                                                              number))
    return earlier.value if earlier.state == TrialState.COMPLETE else None


def duplicate_of(study: Any, number: int, space: Space, params: dict[str, Any]) -> int | None:
    """The trial that already trains or trained the point `params` that trial `number` drew, or None.

    Of two trials that draw one point at once, the later-numbered one gives way, unless the other has
    already passed this check (it is then "distinct" and trains). Trials that only held a point (a
    duplicate, an unused place, a run abandoned and queued again) do not count. Not atomic: two trials whose
    checks interleave between one's check and its "distinct" mark can both train one point (a window of
    milliseconds; the search's report then shows both)."""
    from optuna.trial import TrialState

    key = space.key(params)
    for t in study.get_trials(deepcopy=False):
        if t.number == number or t.user_attrs.get("duplicate_of") is not None or t.user_attrs.get("unused"):
            continue
        if t.state == TrialState.FAIL and "error" not in t.user_attrs:
            continue
        if space.key(t.params) == key and (t.number < number or t.user_attrs.get("distinct")):
            return t.number
    return None


def trial_devices(hardware: Any, index: int) -> tuple[str, ...]:
    """The devices of the trials that pool process `index` runs: GPUs index*D .. index*D+D-1 (disjoint from
    the other processes'), or the CPU."""
    from ..runtime.devices import device_map

    return device_map(hardware, index * hardware.workers)


def train_one(cfg: C.TrainConfig, data: Any, index: int, threads: int, accelerator: str,
              devices_per_trial: int, report: Any = None) -> dict[str, Any]:
    """One trial, a run as `paratrain train` makes one (session.run: its folder held, config.yaml, the plan,
    the launch), so `paratrain train --resume TRIAL` carries it on: in this process on one device, or
    data-parallel on devices_per_trial workers. Pool process `index` owns GPUs index*D .. index*D+D-1."""
    from .. import session
    from ..parallel.strategies import checked
    from ..runtime.devices import Hardware
    from ..runtime.env import LOCAL

    hardware = Hardware(accelerator, devices_per_trial, threads, "nccl" if accelerator == "gpu" else "gloo")
    devices = trial_devices(hardware, index)
    # the trial's point checked as a whole, once (the search checked each value of its space alone)
    cfg = checked(cfg.replace(accelerator=accelerator, devices=str(devices_per_trial)))
    return session.run(cfg, lambda: data, hardware=hardware, devices=devices, report=report, env=LOCAL,
                       last_line=False)


def pool_worker(index: int, s: Settings, space: Space, base: dict[str, Any], threads: int, accelerator: str,
                ignored: int | None = None, ready: Any = None, environ: dict[str, str] | None = None,
                streams: prefork.Streams | None = None) -> None:
    """The entry point of a pool process, forked from the forkserver (runtime/prefork.py) or spawned: a user
    error is one line and its exit code, Ctrl-C exit code 130. `ignored`: a signal the search handles for it
    (Slurm's requeue signal reaches every process of the job; the search then stops this one as on Ctrl-C), and
    so do the processes it starts; the forkserver kept it blocked, let go of once ignored. `environ`, `streams`:
    the search's environment and standard streams at the start (the latter adopted as the arguments were
    unpickled). It ends with the search: a search killed outright ends the forkserver, and with it this process
    (PR_SET_PDEATHSIG), whose trial's workers then end with it."""
    prefork.detach(dict(os.environ) if environ is None else environ)
    if ignored:
        signal.signal(ignored, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {ignored})
    try:
        worker(index, s, space, base, threads, accelerator, ready)
    except UserError as e:
        print(f"paratrain: error: search worker {index}: {e}", file=sys.stderr, flush=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        sys.exit(130)
