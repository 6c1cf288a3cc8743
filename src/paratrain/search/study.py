"""The search's Optuna study: its settings, samplers and pruners, its storage (SQLite, PostgreSQL), how it is
made or joined, and the bookkeeping of its trials (queued, running, finished, abandoned, dead)."""

from __future__ import annotations

import os
import random
import socket
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

from ..core.errors import UserError
from ..core.optional import installed, require
from ..core.urls import masked, scrubbed
from .objective import ACCURACY, Objective
from .space import Space

SAMPLERS = ("grid", "genetic", "tpe", "random")  # Optuna samplers; not a parallelism (--strategy of train)
PRUNERS = ("none", "median", "hyperband")  # Optuna's pruners, fed the validation accuracy after every epoch
HEARTBEAT_S, GRACE_S = 5, 20  # a trial whose worker is silent this long is failed and queued again


@dataclass(frozen=True)
class Settings:
    sampler: str
    population: int
    generations: int
    mutation_prob: float | None
    crossover_prob: float
    trials: int | None
    parallel: int
    devices_per_trial: int
    storage: str
    study: str
    out: str
    seed: int
    worker: bool
    pruner: str = "none"
    keep: str = "best"  # --keep-trial-checkpoints (keep.py)
    objective: Objective = ACCURACY  # --objective: the trials' fitness

    def wanted(self) -> int:
        """The trials asked for (grid: at most these many)."""
        return self.trials or (self.population * self.generations if self.sampler == "genetic" else 20)

    def budget(self, space: Space) -> int:
        """How many trials the search runs."""
        if self.sampler == "grid":
            return min(len(space.grid()), self.trials or len(space.grid()))
        size = space.size()  # every trial is a distinct point: a finite space caps the budget
        return self.wanted() if size is None else min(self.wanted(), size)


def sampler_seed(s: Settings, index: int, done: int = 0) -> int:
    """Each process of a search draws with its own seed: identically seeded samplers in two processes
    proposed the same points. The pool of the search that made the study counts 0..P-1 from --seed, and a
    search resumed after `done` trials starts elsewhere (it would replay its first proposals, all trained);
    a `--worker` on another machine mixes in its host and process, which no other process shares."""
    if not s.worker:
        return s.seed * 1000 + index + 1_000_003 * done
    return zlib.crc32(f"{s.seed}:{socket.gethostname()}:{os.getpid()}:{index}".encode())


def make_sampler(s: Settings, index: int = 0, done: int = 0) -> Any:
    import optuna

    seed = sampler_seed(s, index, done)
    if s.sampler == "genetic":
        from .genetic import PrunedCountingNSGAII

        return PrunedCountingNSGAII(population_size=s.population, mutation_prob=s.mutation_prob,
                                    crossover_prob=s.crossover_prob, seed=seed)
    if s.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # random; grid: every point is queued up front (open_study)


TABLE_RACE_TRIES = 5


def make_pruner(name: str) -> Any:
    """Optuna's pruner for --pruner: median (stop a trial below the median of the others at the same epoch,
    after the first 5 trials and 1 epoch), hyperband, or none."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


class TrialReport:
    """A search trial's objective (its validation accuracy, say) after every epoch, reported to its Optuna
    trial by the training's rank 0, which answers whether the pruner stops it. It travels to spawned workers as
    the storage's URL and the trial's id, and opens the study in the process that calls it first."""

    def __init__(self, url: str, study: str, pruner: str, trial_id: int, trial: Any = None,
                 key: str = "val_accuracy") -> None:
        self.url, self.study, self.pruner, self.trial_id, self.key = url, study, pruner, trial_id, key
        self._trial = trial  # the live trial, in the pool process that runs a one-device trial

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_trial": None}

    def __call__(self, epoch: int, figures: dict[str, float]) -> bool:
        import optuna

        value = figures[self.key]
        try:
            if self._trial is None:
                study = optuna.load_study(study_name=self.study, storage=storage(self.url, create_tables=False),
                                          pruner=make_pruner(self.pruner))
                self._trial = optuna.trial.Trial(study, self.trial_id)
            self._trial.report(value, epoch)
            return bool(self._trial.should_prune())
        except Exception as e:  # noqa: BLE001 (the storage busy or gone): the trial trains on, unpruned
            print(f"paratrain: warning: could not report epoch {epoch} to the search's pruner ({type(e).__name__}: "
                  f"{scrubbed(str(e), self.url)[:200]}); the trial goes on", file=sys.stderr, flush=True)
            return False


def storage(url: str, create_tables: bool = True) -> Any:
    import warnings

    import optuna

    # heartbeats are marked experimental; they are what lets a killed worker's trial run again
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sqlite = url.startswith("sqlite")
    given = url  # what messages show (with its password masked)
    if url.startswith("postgresql://"):  # no driver named: psycopg 3 (the postgres extra's), else psycopg2
        if installed("psycopg"):
            url = "postgresql+psycopg://" + url[len("postgresql://"):]  # SQLAlchemy 2.0's default is psycopg2
        elif not installed("psycopg2"):
            require("psycopg", "a search stored in PostgreSQL")
    # isolation_level None: the driver starts no transaction of its own; _serialise starts each one
    kwargs = {"connect_args": {"timeout": 60, "isolation_level": None}} if sqlite else {"pool_pre_ping": True}
    for attempt in range(TABLE_RACE_TRIES):
        try:
            store = optuna.storages.RDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2),
                skip_table_creation=not create_tables)
            break
        except Exception as e:  # sqlalchemy and the database drivers raise many types
            if _lost_table_race(e) and attempt + 1 < TABLE_RACE_TRIES:
                time.sleep(0.2 + random.random())
                continue
            first = (str(e).splitlines() or [""])[0]
            raise UserError(f"cannot open the search storage {masked(given)} ({type(e).__name__}: "
                            f"{scrubbed(first, given)})") from None
    if sqlite:
        _serialise(store.engine)
    return store


def _lost_table_race(e: Exception) -> bool:
    """Two processes that open a fresh storage together both create its tables: on PostgreSQL the later
    CREATE fails on a duplicate type (IntegrityError), on SQLite on "table ... already exists"
    (OperationalError; both seen in CI). Opened again, the tables are there and nothing more is made."""
    name = type(e).__name__
    return name == "IntegrityError" or (name == "OperationalError" and "already exists" in str(e))


def _serialise(engine: Any) -> None:
    """Make every SQLite transaction take the write lock when it begins (BEGIN IMMEDIATE).

    Optuna hands a queued trial to one worker by reading it WAITING and writing it RUNNING "for update";
    SQLite has no SELECT FOR UPDATE, so two workers both read WAITING and both ran the same grid point
    (optuna/optuna#4002; seen in CI as "Cannot tell a COMPLETE trial"). PostgreSQL honours the row lock.
    """
    from sqlalchemy import event

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def open_study(s: Settings, space: Space, base: dict[str, Any], index: int = 0, pool: bool = False) -> Any:
    """Create the study (queueing the grid's points, recording what the search is) or load it, and refuse to
    mix two different searches in one study. `pool`: a process of the search's pool, which only loads it
    (the search's own process has queued and recorded what there is to do)."""
    import optuna

    what = {"sampler": s.sampler, "space": {p.name: list(p.choices) if p.choices else [p.low, p.high, p.log]
                                                for p in space.params}, "base": base,
            **({"pruner": s.pruner} if s.pruner != "none" else {}),
            **({"objective": s.objective.name} if s.objective != ACCURACY else {})}  # a study of before: accuracy
    if s.worker:  # join a study that another `paratrain search` made (and wait a minute for it to appear)
        for _ in range(60):
            try:
                store = storage(s.storage, create_tables=False)  # two creators of the tables would collide
                if s.study in [x.study_name for x in store.get_all_studies()]:
                    break
            except Exception:  # noqa: BLE001 (no tables yet: the first search is still setting up)
                pass
            time.sleep(1)
        else:
            raise UserError(f"no study '{s.study}' in {masked(s.storage)}; start the search without --worker first")
        study = optuna.load_study(study_name=s.study, storage=store, sampler=make_sampler(s, index),
                                  pruner=make_pruner(s.pruner))
    else:
        store = storage(s.storage)
        study = optuna.create_study(storage=store, sampler=make_sampler(s, index), study_name=s.study,
                                    direction=s.objective.direction, load_if_exists=True, pruner=make_pruner(s.pruner))
    saved = described(study)
    if saved is None and not s.worker:
        if s.sampler == "grid":
            queue_grid(study, space, s)
        study.set_user_attr("search", what)
        study.set_user_attr("budget", s.budget(space))  # last: a joining worker waits for it
    elif s.worker:
        for _ in range(60):
            if "budget" in study.user_attrs:
                break
            time.sleep(1)
        else:
            raise UserError(f"the study '{s.study}' in {masked(s.storage)} was never set up; start it again "
                            "without --worker")
        # its data folder may be elsewhere on this machine, but its trials must be pruned as the others are
        joined = described(study) or {}
        if joined.get("pruner", "none") != s.pruner:
            raise UserError(f"the study '{s.study}' prunes with --pruner {joined.get('pruner', 'none')}; give the "
                            "same --pruner to this worker")
    elif saved is not None and not s.worker and saved != what:
        raise UserError(f"the study '{s.study}' in {masked(s.storage)} was made by another search "
                        f"({_differences(saved, what)}); use another --out or --study, or the same options to carry "
                        "that search on")
    elif saved is not None and not s.worker and not pool:  # the same search again, perhaps with more --trials
        if s.sampler == "grid":
            queue_grid(study, space, s)
        study.set_user_attr("budget", s.budget(space))
    return study


def queue_grid(study: Any, space: Space, s: Settings) -> None:
    """Queue grid points until the study holds the budget's worth: all of them for a new study, and the
    new ones when a search is run again with more --trials. The grid is shuffled by --seed, so a budget
    below it takes a fair sample of it; a point the study holds (queued, run or failed) is not queued
    again."""
    def key(point: dict[str, Any]) -> tuple:
        return tuple(sorted(point.items()))

    # a trial stopped while drawing holds part of its point in params: its queued point is the whole
    held = {key({**t.system_attrs.get("fixed_params", {}), **t.params}) for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("grid_point")}
    points = space.grid()
    random.Random(s.seed).shuffle(points)
    new = [p for p in points if key(p) not in held][: max(0, s.budget(space) - len(held))]
    for point in new:
        study.enqueue_trial(point, user_attrs={"grid_point": True})


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between the search that made a study and this one, in words."""
    found = []
    if saved.get("sampler") != now["sampler"]:
        found.append(f"sampler {saved.get('sampler')} there, {now['sampler']} here")
    if saved.get("pruner", "none") != now.get("pruner", "none"):
        found.append(f"pruner {saved.get('pruner', 'none')} there, {now.get('pruner', 'none')} here")
    if saved.get("objective", "accuracy") != now.get("objective", "accuracy"):
        found.append(f"objective {saved.get('objective', 'accuracy')} there, {now.get('objective', 'accuracy')} here")
    if saved.get("space") != now["space"]:
        found.append("another space")
    old, new = saved.get("base", {}), now["base"]
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            found.append(f"{key} {old.get(key)!r} there, {new.get(key)!r} here")
    return "; ".join(found[:4]) or "its options differ"


def described(study: Any) -> dict[str, Any] | None:
    """What search made the study (sampler, space, fixed options); studies made before the sampler had its
    own name recorded it as "strategy"."""
    saved = study.user_attrs.get("search")
    if saved is not None and "strategy" in saved:
        saved = {"sampler": saved["strategy"], **{k: v for k, v in saved.items() if k != "strategy"}}
    return saved


def requeue_abandoned(study: Any, workers: set[str] | None = None) -> int:
    """Trials that a killed or interrupted search left unfinished (this machine's own SQLite study): still
    marked running, or failed without a training error (Ctrl-C). Their parameters are queued again, once, so
    they run again and nothing that finished runs twice. `workers` (host:pid): only the running trials of
    these pool processes, which have stopped (a search stopped by Slurm's requeue signal, in a shared study)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials} | {t.system_attrs.get("failed_trial") for t in trials}
    abandoned = [t for t in trials if (t.state == TrialState.RUNNING or (
        t.state == TrialState.FAIL and "error" not in t.user_attrs and t.number not in retried))
        and (workers is None or t.user_attrs.get("worker") in workers)]
    for t in abandoned:
        if t.state == TrialState.RUNNING:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        # a trial killed before it drew its parameters has them only as the queue's fixed_params
        params = {**t.system_attrs.get("fixed_params", {}), **t.params}
        study.enqueue_trial(params, user_attrs={**t.user_attrs, "retry_of": t.number})
    return len(abandoned)


def after_death(study: Any, worker: str, how: str) -> str:
    """The pool process `worker` (host:pid) died, most often killed for memory in the middle of a trial that
    runs in it: that trial is queued once more; one that already was (it killed its process twice) is
    failed with the reason, and the search goes on. Returns what was done, in words."""
    import optuna
    from optuna.trial import TrialState

    said: list[str] = []
    for t in study.get_trials(deepcopy=False):
        if t.state != TrialState.RUNNING or t.user_attrs.get("worker") != worker:
            continue
        try:
            _bury(study, t, how, said)
        except optuna.exceptions.UpdateFinishedTrialError:  # the stale-heartbeat callback got there first
            continue
    return "; ".join(said) or "it was between trials"


def _bury(study: Any, t: Any, how: str, said: list[str]) -> None:
    """after_death for one trial of the dead process."""
    from optuna.trial import TrialState

    # attributes first: a finished trial takes no more
    study._storage.set_trial_user_attr(t._trial_id, "process_died", how)  # trials.csv says so
    if "died" in t.user_attrs:  # its second life ended the same way
        study._storage.set_trial_user_attr(t._trial_id, "error", f"its process died twice ({how}; out of "
                                           "memory?); not tried again")
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        said.append(f"trial {t.number} failed (its process died twice)")
        return
    study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    params = {**t.system_attrs.get("fixed_params", {}), **t.params}
    kept = {k: v for k, v in t.user_attrs.items() if k not in ("worker", "process_died")}
    study.enqueue_trial(params, user_attrs={**kept, "retry_of": t.number, "died": how})
    said.append(f"trial {t.number} is queued again, once")


def counts(study: Any) -> tuple[int, int, int]:
    """(finished, running, waiting) trials; a failure counts as finished when the training itself failed
    (it would fail again), not when its worker vanished (it is queued again)."""
    from optuna.trial import TrialState

    finished = running = waiting = 0
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("duplicate_of") is not None:  # reused or redrawn: no training, no place in the budget
            continue
        trained = t.state == TrialState.PRUNED and "pruned_at_epoch" in t.user_attrs  # stopped by the pruner
        if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "error" in t.user_attrs) or trained:
            finished += 1
        elif t.state == TrialState.RUNNING:
            running += 1
        elif t.state == TrialState.WAITING:
            waiting += 1
    return finished, running, waiting


def over_budget(study: Any, number: int, budget: int) -> bool:
    """Whether trial `number`, just started, is one too many: two workers that both saw one place left
    (budget - 1 trials finished) both start a trial; the later-numbered one gives way."""
    from optuna.trial import TrialState

    finished, _, _ = counts(study)
    earlier = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if t.number < number)
    return finished + earlier >= budget
