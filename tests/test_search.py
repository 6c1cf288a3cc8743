"""paratrain search: spaces, grid and genetic searches with parallel trials, resuming, and PostgreSQL."""

from __future__ import annotations

import contextlib
import csv
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import free_port, left_in_session, logged_step, run_cli, train_here

from paratrain.core.errors import UserError
from paratrain.search import space

SPACE = "fixed: {model: mlp, dataset: synthetic}\nparams:\n  width: [16, 32]\n  lr: [0.001, 0.003, 0.01]\n"
PRODUCT = [{"width": w, "lr": lr} for w, lr in itertools.product([16, 32], [0.001, 0.003, 0.01])]


def _space_file(tmp_path: Path, text: str = SPACE) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def _complete(out: Path) -> list[dict]:
    """The completed trainings (a proposal that reused a finished trial's value is no training)."""
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    by_number = {r["number"]: r for r in rows}
    for r in rows:  # a reused value is the earlier trial's, for the same parameters
        if r.get("reused"):
            earlier = by_number[r["reused"].removeprefix("trial ")]
            assert (r["val_accuracy"], r["lr"]) == (earlier["val_accuracy"], earlier["lr"]), (r, earlier)
    return [r for r in rows if r["state"] == "COMPLETE" and not r.get("reused")]


def test_bundled_spaces_parse() -> None:
    mlp = space.load("mlp-mnist")
    assert {p.name for p in mlp.params} == {"width", "depth", "activation", "optimizer"}
    assert len(mlp.grid()) == 6 * 4 * 4 * 7
    cnn = space.load("cnn-mnist")
    assert {p.name for p in cnn.params} == {"filters", "kernel", "dropout", "lr", "batch_size"}
    with pytest.raises(UserError, match="grid search needs a list of choices"):
        cnn.grid()


def test_grid_is_exactly_the_product() -> None:
    grid = space.parse({"fixed": {"model": "mlp"}, "params": {"width": [16, 32], "lr": [0.001, 0.003, 0.01]}}).grid()
    assert sorted(grid, key=repr) == sorted(PRODUCT, key=repr)


@pytest.mark.parametrize(("data", "message"), [
    ([1, 2], "must be a mapping with 'params'"),
    ({"params": {}}, "must be a mapping with 'params'"),
    ({"params": {"neurons": [1, 2]}}, "'neurons' is not a `paratrain train` option"),
    ({"params": {"out": ["a", "b"]}}, "a space cannot search 'out': each trial runs in OUT/trials/NNNN"),
    ({"fixed": {"seed": 3}, "params": {"width": [8, 16]}}, "cannot fix 'seed': the search's --seed seeds every trial"),
    ({"fixed": {"devices": 2}, "params": {"width": [8, 16]}}, "cannot fix 'devices': the search's --devices-per-trial"),
    ({"params": {"data_dir": ["a", "b"]}}, "data_dir can be fixed, not searched"),
    ({"params": {"image_size": [16, 32]}}, "image_size can be fixed, not searched"),
    ({"fixed": [1], "params": {"width": [8, 16]}}, "'fixed' must be a mapping"),
    ({"params": {"width": []}}, "needs a list of distinct choices"),
    ({"params": {"width": [8, 8]}}, "needs a list of distinct choices"),
    ({"params": {"lr": {"low": 0.1, "high": 0.01}}}, "range needs numbers low < high"),
    ({"params": {"lr": {"low": 0, "high": 0.1, "log": True}}}, "low > 0 with log"),
    ({"params": {"lr": "fast"}}, "must be a list of choices or a range"),
    ({"params": {"optimizer": ["adam", "lbfgs"]}}, "optimizer = 'lbfgs' is not a valid value"),
    ({"params": {"width": [8]}, "extra": 1}, "unknown section(s) extra"),
    ({"fixed": {"width": 8}, "params": {"width": [8, 16]}}, "both fixed and searched"),
])
def test_bad_spaces(data: object, message: str) -> None:
    with pytest.raises(UserError, match=None) as e:
        space.parse(data)
    assert message in str(e.value)


def test_search_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main

    path = _space_file(tmp_path)
    for args, message in ((("--sampler", "annealing"), "unknown --sampler 'annealing'"),
                          (("--strategy", "genetic"), "the search's sampler is --sampler genetic"),
                          (("--strategy", "rings"), "unknown --strategy 'rings'; each trial's parallelism is one of"),
                          (("--pruner", "asha"), "unknown --pruner 'asha'; choose one of: none, median, hyperband"),
                          (("--lr", "0.1"), "--lr is a searched parameter"),
                          (("--parallel", "64"), "exceed the"),
                          (("--population", "0"), "--population must be at least 1"),
                          (("--epochs-per-trial", "0"), "--epochs must be at least 1"),
                          (("--epochs-per-trial", "2", "--epochs", "3"), "not both"),
                          (("--time-budget", "0"), "--time-budget must be a number of seconds above 0")):
        code = main(["search", "--space", path, "--out", str(tmp_path / "o"), *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert main(["search", "--space", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot read the space file" in capsys.readouterr().err


@pytest.mark.integration
def test_grid_search_runs_every_point_once(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    proc = run_cli("search", "--space", _space_file(tmp_path), "--sampler", "grid", "--parallel", "2",
                   "--steps", "3", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = _complete(out)
    assert sorted((int(r["width"]), float(r["lr"])) for r in done) == sorted((p["width"], p["lr"]) for p in PRODUCT)
    import json

    for r in done:  # the fitness is each trial's validation accuracy, never its test accuracy
        summary = json.loads((out / "trials" / f"{int(r['number']):04d}" / "summary.json").read_text())
        assert float(r["val_accuracy"]) == summary["val_accuracy"]
    assert any(summary["val_accuracy"] != summary["test_accuracy"] for summary in
               (json.loads(p.read_text()) for p in (out / "trials").glob("*/summary.json")))
    for name in ("best.yaml", "leaderboard.md", "fitness.png", "summary.yaml"):
        assert (out / name).stat().st_size > 0
    # best.yaml is a config `paratrain train` takes
    train_here(tmp_path / "best", "--config", str(out / "best.yaml"), "--steps", "2", "--devices", "1")
    # 6 trainings of 2 parameters say nothing of their importance: no plot, and a line that says why
    assert "no parameter importance: 6 trainings finished, and 2 parameters need 10" in proc.stdout, proc.stdout
    assert not (out / "importance.png").exists()
    # --keep-trial-checkpoints best (the default): the best trial alone keeps step checkpoints
    best_number = yaml.safe_load((out / "summary.yaml").read_text())["best_trial"]
    with_steps = sorted({int(p.parent.parent.name) for p in (out / "trials").glob("*/checkpoints/step-*")})
    assert with_steps == [best_number], with_steps
    kept = sorted(int(p.parent.parent.name) for p in (out / "trials").glob("*/checkpoints/last.pt"))
    assert len(kept) == 5 and best_number not in kept, kept  # the others' weights, one file each


@pytest.mark.integration
def test_a_grid_search_run_again_with_more_trials_trains_the_new_points(tmp_path: Path) -> None:
    """--trials 2, then the same command with --trials 5: three more points of the grid are trained, none twice
    (it stopped at the first two and said "2/5 trials done")."""
    out = tmp_path / "grid"
    args = ("search", "--space", _space_file(tmp_path), "--sampler", "grid", "--parallel", "1", "--steps", "2",
            "--out", str(out))
    first = run_cli(*args, "--trials", "2", timeout=600)
    assert first.returncode == 0 and len(_complete(out)) == 2, first.stderr[-3000:]
    before = yaml.safe_load((out / "summary.yaml").read_text())["wall_time_s"]
    again = run_cli(*args, "--trials", "5", timeout=600)
    assert again.returncode == 0 and "5 trials (2 already done)" in again.stdout, again.stderr[-3000:]
    # the search's wall time is both starts' (the summary once held the last start's alone)
    assert yaml.safe_load((out / "summary.yaml").read_text())["wall_time_s"] > before
    assert " s in this start)" in again.stdout, again.stdout
    points = [(int(r["width"]), float(r["lr"])) for r in _complete(out)]
    assert len(points) == len(set(points)) == 5, points
    assert set(points) <= {(p["width"], p["lr"]) for p in PRODUCT}


@pytest.mark.integration
def test_genetic_two_generations_of_four_with_two_parallel_trials(tmp_path: Path) -> None:
    out = tmp_path / "ga"
    wide = SPACE.replace("[0.001, 0.003, 0.01]", "[0.001, 0.002, 0.003, 0.005, 0.01, 0.02]")  # 12 points for 8
    proc = run_cli("search", "--space", _space_file(tmp_path, wide), "--sampler", "genetic", "--population", "4",
                   "--generations", "2", "--parallel", "2", "--steps", "3", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = _complete(out)
    assert len(done) == 8  # 4 x 2 distinct networks trained; a member equal to a trained one reused its value,
    generations = sorted(int(r["generation"]) for r in done)  # so later generations may hold the last ones
    # generation 0 takes the trials started before 4 of them finished (with 2 at once, up to 5; fewer
    # trainings where a member reused a value): 8 trainings reach a later generation
    assert generations[0] == 0 and generations.count(0) <= 5 and generations[-1] >= 1, generations
    assert len({r["worker"] for r in done}) == 2  # two trial processes shared the work
    assert "search: best validation accuracy" in proc.stdout


@pytest.mark.integration
def test_killed_search_resumes_without_repeating_finished_trials(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    cmd = [sys.executable, "-m", "paratrain", "search", "--space", _space_file(tmp_path), "--sampler", "grid",
           "--parallel", "1", "--steps", "40", "--out", str(out)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 180
        while len(list(out.glob("trials/*/summary.json"))) < 2:
            assert time.time() < deadline and first.poll() is None, "the search did not get going"
            time.sleep(0.2)
        # the search alone, mid-trial (as the out-of-memory killer would): its pool process ends with it, at once
        # (a spawned pool process outlived it and trained every trial left; the one ending as the kill came may
        # still write its summary)
        ended = len(list(out.glob("trials/*/summary.json")))
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert not (left := left_in_session(first.pid, 10)), f"processes of the killed search still run: {left}"
        assert len(list(out.glob("trials/*/summary.json"))) <= ended + 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    import optuna

    # finished = recorded in the study (a trial killed between training and being recorded runs again)
    study = optuna.load_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}")
    finished_before = {t.number: (t.params, t.value, t.datetime_complete)
                       for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    assert finished_before  # the kill came after at least one trial was recorded
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = _complete(out)
    assert len(done) == 6 and len({(r["width"], r["lr"]) for r in done}) == 6  # every point once
    # Every trial finished before the kill is kept as it was: same parameters, same value, not run again.
    after = {t.number: (t.params, t.value, t.datetime_complete)
             for t in optuna.load_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}").get_trials(
                 states=(optuna.trial.TrialState.COMPLETE,))}
    assert {n: after.get(n) for n in finished_before} == finished_before
    assert {int(r["number"]) for r in done} >= set(finished_before)


@pytest.mark.integration
def test_a_search_of_two_worker_trials_stops_on_sigterm_and_killed_leaves_no_process(tmp_path: Path) -> None:
    """SIGTERM to the search alone stops it as Ctrl-C does (its trial's workers stop at their step), exit 143
    and one line; kill -9 of the search alone takes its pool process, that one's forkserver and the trial's two
    workers with it; then the same command finishes every point."""
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "paratrain", "search", "--space", _space_file(
        tmp_path, "fixed: {model: mlp, dataset: digits}\nparams:\n  lr: [0.001, 0.002, 0.003]\n"),
        "--sampler", "grid", "--parallel", "1", "--devices-per-trial", "2", "--steps", "150", "--out", str(out)]

    def started() -> subprocess.Popen:
        search = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        deadline = time.monotonic() + 180
        while not any(logged_step(run) >= 5 for run in out.glob("trials/*")):  # a trial's 2 workers train
            assert time.monotonic() < deadline and search.poll() is None, "the search did not get going"
            time.sleep(0.1)
        return search

    for signum, code in ((signal.SIGTERM, 143), (signal.SIGKILL, -9)):
        search = started()
        try:
            os.kill(search.pid, signum)
            assert search.wait(timeout=60) == code, search.stderr.read()[-2000:]
            left = left_in_session(search.pid, 10)
            assert not left, f"processes of the search still run after {signal.Signals(signum).name}: {left}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(search.pid, signal.SIGKILL)
        if signum == signal.SIGTERM:
            assert "paratrain: search stopped by SIGTERM" in search.stderr.read()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(float(r["lr"]) for r in _complete(out)) == [0.001, 0.002, 0.003]


# ---- a study shared through a real PostgreSQL server ----

@pytest.mark.integration
def test_two_workers_share_a_postgresql_study(tmp_path: Path, postgres: str) -> None:
    import optuna

    common = ["--space", _space_file(tmp_path), "--sampler", "grid", "--storage", postgres, "--study", "shared",
              "--parallel", "1", "--steps", "60"]
    # the helper starts first (it waits for the study): started second, its worker may come up to a taken grid
    helper = subprocess.Popen([sys.executable, "-m", "paratrain", "search", *common, "--worker", "--out",
                               str(tmp_path / "b")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    main = subprocess.Popen([sys.executable, "-m", "paratrain", "search", *common, "--out", str(tmp_path / "a")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for proc in (main, helper):
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    study = optuna.load_study(study_name="shared", storage=postgres)
    trials = [t for t in study.get_trials() if not t.user_attrs.get("unused")]
    seen = [(t.number, t.state.name, t.params, t.user_attrs) for t in study.get_trials()]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6, seen  # none lost, none failed
    assert sorted((t.params["width"], t.params["lr"]) for t in trials) == sorted(
        (p["width"], p["lr"]) for p in PRODUCT), seen  # none duplicated
    assert len({t.user_attrs["worker"] for t in trials}) == 2, seen  # both machines' workers took part


def test_two_workers_that_see_the_last_place_do_not_both_take_it() -> None:
    """The genetic search once ran 9 trials for a budget of 8: both workers saw 7 finished and started one.
    The later-numbered of two trials started together gives way."""
    import optuna

    from paratrain.search.study import over_budget

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for value in range(7):
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=float(value)))
    first, second = study.ask(), study.ask()  # both RUNNING, numbers 7 and 8
    assert not over_budget(study, first.number, 8)
    assert over_budget(study, second.number, 8)
    assert not over_budget(study, second.number, 9)


def test_a_queued_trial_goes_to_one_worker_only(tmp_path: Path) -> None:
    """CI once ran a grid point twice ("Cannot tell a COMPLETE trial"): on SQLite, two workers both read a
    queued trial WAITING and both took it (optuna#4002). Four storages pop a queue of 40 at once."""
    import collections
    import threading

    import optuna

    from paratrain.search.study import storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path}/study.db"
    study = optuna.create_study(storage=storage(url), study_name="queue")
    for i in range(40):
        study.enqueue_trial({"i": i})
    taken: collections.Counter[int] = collections.Counter()

    def take() -> None:
        mine = optuna.load_study(study_name="queue", storage=storage(url, create_tables=False))
        while (trial_id := mine._pop_waiting_trial_id()) is not None:
            taken[trial_id] += 1

    workers = [threading.Thread(target=take) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(taken) == 40
    assert [t for t, n in taken.items() if n > 1] == []


class IntegrityError(Exception):  # what sqlalchemy raises, by name
    pass


class OperationalError(Exception):
    pass


@pytest.mark.parametrize("race", [
    IntegrityError('duplicate key value violates unique constraint "pg_type_typname_nsp_index"'),  # PostgreSQL
    OperationalError("(sqlite3.OperationalError) table trial_user_attributes already exists")])  # SQLite
def test_a_storage_whose_tables_another_machine_is_creating_is_tried_again(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path, race: Exception) -> None:
    """Two processes opening a fresh storage together both create the tables; the later CREATE failed (on
    PostgreSQL a duplicate pg_type, on SQLite a table that already exists) and the search ended. It is tried
    again, and other errors are not."""
    import optuna

    from paratrain.search import study as studies

    real, calls = optuna.storages.RDBStorage, []

    def racing(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise race
        return real(*args, **kwargs)

    monkeypatch.setattr(studies.time, "sleep", lambda s: None)
    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    assert studies.storage(f"sqlite:///{tmp_path / 'a.db'}") is not None and len(calls) == 2

    for error in (ValueError("no such database"), OperationalError("unable to open database file")):
        def broken(*args: object, error: Exception = error, **kwargs: object) -> object:
            calls.append(1)
            raise error

        calls.clear()
        monkeypatch.setattr(optuna.storages, "RDBStorage", broken)
        with pytest.raises(UserError, match="cannot open the search storage"):
            studies.storage(f"sqlite:///{tmp_path / 'b.db'}")
        assert len(calls) == 1


def _open_storage(url: str, barrier: Any, answers: Any) -> None:
    from paratrain.search.study import storage

    barrier.wait()
    try:
        storage(url)
        answers.put("opened")
    except UserError as e:
        answers.put(str(e))


@pytest.mark.integration
def test_two_processes_opening_one_fresh_sqlite_storage_at_once_both_open_it(tmp_path: Path) -> None:
    """A probe of the study while the search made its tables ended the search in CI ("table
    trial_user_attributes already exists"). Without the retry, 20 of 20 such pairs had one fail."""
    import multiprocessing

    import optuna.storages  # noqa: F401 (imported here, once: the forked pair starts level)

    ctx = multiprocessing.get_context("fork")  # quick to start, so the pair opens together (spawn: 4 s a pair)
    for round in range(4):
        barrier, answers = ctx.Barrier(2), ctx.Queue()
        url = f"sqlite:///{tmp_path / f'{round}.db'}"
        opening = [ctx.Process(target=_open_storage, args=(url, barrier, answers)) for _ in range(2)]
        for p in opening:
            p.start()
        for p in opening:
            p.join(timeout=120)
        assert [answers.get(timeout=10) for _ in opening] == ["opened", "opened"]


@pytest.mark.integration
@pytest.mark.parametrize("sampler", ["grid", "random", "tpe", "genetic"])
def test_two_processes_train_every_point_once(tmp_path: Path, sampler: str) -> None:
    """Both pool processes once built identically seeded samplers: TPE trained trials 0 and 1, then 2 and 3,
    with the same parameters. Asked for 10 trials of a 6-point space, every sampler trains the 6 points
    once each (a proposal that repeats a trained point is drawn again) and says why it stops at 6."""
    out = tmp_path / sampler
    budget = ["--population", "5", "--generations", "2"] if sampler == "genetic" else ["--trials", "10"]
    proc = run_cli("search", "--space", _space_file(tmp_path), "--sampler", sampler, *budget, "--parallel", "2",
                   "--steps", "2", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = _complete(out)
    assert sorted((int(r["width"]), float(r["lr"])) for r in done) == sorted((p["width"], p["lr"]) for p in PRODUCT)
    assert len({r["worker"] for r in done}) == 2  # both processes drew and trained
    if sampler != "grid":
        assert "the space has 6 distinct points; each is trained once, so 6 trials, not 10" in proc.stdout


def test_a_point_already_drawn_is_a_duplicate_at_the_space_precision() -> None:
    import optuna

    from paratrain.search.runner import duplicate_of

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sp = space.parse({"params": {"lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}, "width": [16, 32]}})
    assert sp.size() is None and space.parse({"params": {"depth": {"low": 1, "high": 3}, "width": [8]}}).size() == 3
    study = optuna.create_study(direction="maximize")
    dist = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
            "width": optuna.distributions.CategoricalDistribution([16, 32])}
    study.add_trial(optuna.trial.create_trial(params={"lr": 0.00123456, "width": 16}, distributions=dist, value=0.5))
    later = study.ask()
    assert duplicate_of(study, later.number, sp, {"lr": 0.0012346, "width": 16}) == 0  # equal at 4 digits
    assert duplicate_of(study, later.number, sp, {"lr": 0.0012356, "width": 16}) is None
    assert duplicate_of(study, later.number, sp, {"lr": 0.00123456, "width": 32}) is None
    # two drawn at once: the later-numbered gives way, the earlier trains unless the later already passed
    first, second = study.ask(), study.ask()
    point = {"lr": 0.005, "width": 32}
    for t in (first, second):
        study._storage.set_trial_param(t._trial_id, "lr", 0.005, dist["lr"])
        study._storage.set_trial_param(t._trial_id, "width", 1, dist["width"])
    assert duplicate_of(study, second.number, sp, point) == first.number
    assert duplicate_of(study, first.number, sp, point) is None
    second.set_user_attr("distinct", True)
    assert duplicate_of(study, first.number, sp, point) == second.number
    # a draw only repeats trials that train: a duplicate or an abandoned run holds no point
    second.set_user_attr("duplicate_of", 0)
    assert duplicate_of(study, first.number, sp, point) is None


def test_each_process_and_each_resumed_search_draws_its_own_points() -> None:
    """Identically seeded samplers proposed the same points in both pool processes, and a resumed search
    replayed its first proposals (all trained by then)."""
    import optuna

    from paratrain.search.study import Settings, make_sampler, sampler_seed

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sp = space.parse({"params": {"width": list(range(8, 108)), "lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}}})

    def first_point(settings: Settings, index: int, done: int = 0) -> tuple:
        study = optuna.create_study(sampler=make_sampler(settings, index, done))
        return sp.key(sp.suggest(study.ask()))

    for sampler in ("random", "tpe", "genetic"):
        s = Settings(sampler, 4, 2, None, 0.9, 8, 2, 1, "sqlite://", "s", "out", 0, False)
        assert first_point(s, 0) == first_point(s, 0)  # seeded: a search is repeatable
        assert first_point(s, 0) != first_point(s, 1)  # but two processes differ
        assert first_point(s, 0) != first_point(s, 0, done=6)  # and so does a search resumed after 6 trials
    worker = Settings("random", 4, 2, None, 0.9, 8, 2, 1, "sqlite://", "s", "out", 0, True)
    own = Settings("random", 4, 2, None, 0.9, 8, 2, 1, "sqlite://", "s", "out", 0, False)
    assert sampler_seed(worker, 0) not in {sampler_seed(own, i) for i in range(64)}  # another machine


def test_trials_that_hold_no_training_are_no_duplicates() -> None:
    import optuna
    from optuna.trial import TrialState

    from paratrain.search.runner import duplicate_of

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sp = space.parse({"params": {"width": [16, 32]}})
    study = optuna.create_study(direction="maximize")
    dist = {"width": optuna.distributions.CategoricalDistribution([16, 32])}
    for state, attrs in ((TrialState.FAIL, {}), (TrialState.PRUNED, {"unused": True}),
                         (TrialState.PRUNED, {"duplicate_of": 0})):
        study.add_trial(optuna.trial.create_trial(params={"width": 16}, distributions=dist, state=state,
                                                  user_attrs=attrs))
    later = study.ask()
    assert duplicate_of(study, later.number, sp, {"width": 16}) is None  # abandoned, unused, a duplicate
    study.add_trial(optuna.trial.create_trial(params={"width": 16}, distributions=dist, state=TrialState.FAIL,
                                              user_attrs={"error": "the loss became nan"}))
    assert duplicate_of(study, study.ask().number, sp, {"width": 16}) == 4  # failed for its own reasons: trained
    assert sp.size() == 2 and space.parse({"params": {"lr": [0.1, 0.100001, 0.2]}}).size() == 2


def test_messages_name_what_differs_and_the_likely_key() -> None:
    from paratrain.search.study import _differences

    with pytest.raises(UserError, match="'widht' is not a `paratrain train` option; did you "
                                        "mean 'width'\\?"):
        space.parse({"params": {"widht": [8, 16]}})
    old = {"sampler": "random", "space": {"width": [8, 16]}, "base": {"steps": 5, "seed": 0}}
    new = {"sampler": "random", "space": {"width": [8, 16]}, "base": {"steps": 6, "seed": 0}}
    assert _differences(old, new) == "steps 5 there, 6 here"
    assert _differences({**old, "sampler": "tpe"}, old) == "sampler tpe there, random here"
    assert _differences({**old, "pruner": "median"}, old) == "pruner median there, none here"


def test_pruned_trainings_are_members_of_their_generation() -> None:
    """With a pruner, most trainings end PRUNED; Optuna's NSGA-II counts only COMPLETE trials in a generation
    (generation 0 of an MNIST search took 116 trainings). Here every training counts, with its last reported
    value; a pruned trial that held no training (a redrawn duplicate) does not."""
    import optuna

    from paratrain.search.genetic import PrunedCountingNSGAII

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_int("x", 0, 1000)
        if trial.number % 5 == 4:
            raise optuna.TrialPruned()  # a redrawn duplicate: nothing reported, no training
        trial.report(x / 1000, 1)
        if trial.number % 5:  # three of the four trainings are pruned
            raise optuna.TrialPruned()
        return x / 1000

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    key = "NSGAIISampler:generation"
    ours = optuna.create_study(direction="maximize", sampler=PrunedCountingNSGAII(population_size=4, seed=0))
    ours.optimize(objective, n_trials=15)
    trained = [t for t in ours.trials if t.intermediate_values]
    assert [t.system_attrs[key] for t in trained] == [0] * 4 + [1] * 4 + [2] * 4
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in ours.trials) == 3  # the study keeps PRUNED
    plain = optuna.create_study(direction="maximize", sampler=optuna.samplers.NSGAIISampler(population_size=4, seed=0))
    plain.optimize(objective, n_trials=15)
    assert {t.system_attrs[key] for t in plain.trials} == {0}  # Optuna's own: 3 COMPLETE, still generation 0


def test_the_last_line_says_how_the_trainings_ended() -> None:
    from paratrain.search.command import _trainings

    result = {"complete": 23, "pruned": 177, "failed": 0, "reused": 43, "redrawn": 44}
    assert _trainings(result) == ("200 trainings (23 to the end, 177 pruned; 43 proposals reused a finished trial's "
                                  "value; 44 repeated a point in training and were drawn again)")
    assert _trainings({**result, "failed": 2, "reused": 0, "redrawn": 0}) == \
        "202 trainings (23 to the end, 177 pruned, 2 failed)"


def test_a_worker_that_would_prune_otherwise_is_refused(tmp_path: Path) -> None:
    from paratrain.search.study import Settings, open_study

    sp = space.parse({"fixed": {"model": "mlp", "dataset": "synthetic"}, "params": {"width": [8, 16]}})
    url = f"sqlite:///{tmp_path / 'study.db'}"
    base = {"model": "mlp", "dataset": "synthetic", "seed": 0}
    open_study(Settings("random", 4, 2, None, 0.9, 2, 1, 1, url, "s", str(tmp_path), 0, False, "median"), sp, base)
    joined = open_study(Settings("random", 4, 2, None, 0.9, 2, 1, 1, url, "s", str(tmp_path), 0, True, "median"),
                        sp, {**base, "data_dir": "elsewhere"})  # a data folder of its own machine is no difference
    assert joined.user_attrs["budget"] == 2
    with pytest.raises(UserError, match="prunes with --pruner median; give the same --pruner to this worker"):
        open_study(Settings("random", 4, 2, None, 0.9, 2, 1, 1, url, "s", str(tmp_path), 0, True, "none"), sp, base)


def test_no_trial_starts_after_the_time_budget(tmp_path: Path) -> None:
    """--time-budget: the pool's processes start no trial once the deadline in the study has passed."""
    from paratrain.search.runner import worker
    from paratrain.search.study import Settings, counts, open_study

    sp = space.parse({"fixed": {"model": "mlp", "dataset": "synthetic"}, "params": {"width": [8, 16, 32]}})
    base = {"model": "mlp", "dataset": "synthetic", "seed": 0, "steps": 1}
    s = Settings("random", 4, 2, None, 0.9, 3, 1, 1, f"sqlite:///{tmp_path / 'study.db'}", "s", str(tmp_path), 0,
                 False)
    study = open_study(s, sp, base)
    study.set_user_attr("deadline", time.time() - 1)
    worker(0, s, sp, base, 1, "cpu")
    assert counts(study) == (0, 0, 0)
    study.set_user_attr("deadline", time.time() + 3600)
    worker(0, s, sp, base, 1, "cpu")
    assert counts(study)[0] == 3


def test_a_pool_process_takes_trials_once_the_others_are_ready_or_gone(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's first processes wait for each other before taking trials (one once trained every trial while
    the other imported torch): no longer than READY_WAIT_S, and not at all once the search says one ended."""
    from paratrain.search import runner
    from paratrain.search.study import Settings, counts, open_study

    monkeypatch.setattr(runner, "READY_WAIT_S", 1.0)

    def waited(flags: list[int], index: int = 0) -> float:
        started = time.monotonic()
        runner.wait_for_the_others(flags, index)
        assert flags[index] == 1  # it said it is ready
        return time.monotonic() - started

    assert waited([0, 0, 0]) >= 1.0  # the other never came
    assert waited([0, 1, 0]) < 0.5  # it came
    assert waited([0, 0, 1]) < 0.5  # it ended: go on
    assert waited([1, 0, 0, 0], index=2) >= 1.0  # one of three still missing

    sp = space.parse({"fixed": {"model": "mlp", "dataset": "synthetic"}, "params": {"width": [8, 16, 32]}})
    base = {"model": "mlp", "dataset": "synthetic", "seed": 0, "steps": 1}
    s = Settings("random", 4, 2, None, 0.9, 3, 1, 1, f"sqlite:///{tmp_path / 'study.db'}", "s", str(tmp_path), 0,
                 False)
    study = open_study(s, sp, base)
    flags = [0, 1, 0]  # the pool's other process is ready: this one trains
    runner.worker(0, s, sp, base, 1, "cpu", flags)
    assert counts(study)[0] == 3 and flags == [1, 1, 0]


# ---- a password in the storage URL stays secret ----

def _files_hold(folder: Path, secret: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_storage_password_is_masked_in_every_spelling() -> None:
    from paratrain.core.urls import masked, scrubbed

    url = "postgresql://alice:s3cret%40PW@db.example:5432/search"
    assert masked(url) == "postgresql://alice:***@db.example:5432/search"
    assert scrubbed(f"FATAL: password s3cret@PW refused for {url}", url) == \
        "FATAL: password *** refused for postgresql://alice:***@db.example:5432/search"
    assert masked("sqlite:////tmp/study.db") == "sqlite:////tmp/study.db"


@pytest.mark.integration
def test_a_storage_password_is_in_no_output_and_no_file(tmp_path: Path, postgres: str) -> None:
    secret = "s3cretPW"
    refused = run_cli("search", "--space", _space_file(tmp_path), "--sampler", "grid", "--out", str(tmp_path / "a"),
                      "--storage", f"postgresql://alice:{secret}@127.0.0.1:{free_port()}/db", "--steps", "5")
    assert refused.returncode == 2 and "cannot open the search storage postgresql://alice:***@" in refused.stderr
    # the server trusts every local connection, so a password in the URL connects too
    with_password = postgres.replace("postgres@", f"postgres:{secret}@", 1)
    env = {**os.environ, "PARATRAIN_STORAGE": with_password}  # from the environment, not the command line
    ran = subprocess.run([sys.executable, "-m", "paratrain", "search", "--space", _space_file(tmp_path), "--sampler",
                          "grid", "--out", str(tmp_path / "b"), "--study", "secret", "--parallel", "1",
                          "--trials", "2", "--steps", "5"], capture_output=True, text=True, env=env, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "in postgresql://postgres:***@127.0.0.1" in ran.stdout  # the start line names the storage, masked
    for output in (refused.stdout, refused.stderr, ran.stdout, ran.stderr):
        assert secret not in output
    assert _files_hold(tmp_path, secret) == []  # no file of either search: study.db, yaml, csv, logs


# ---- every kind of parallelism in a trial ----

def test_trials_of_two_gpus_each_take_disjoint_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With an inventory of 4 GPUs (faked), two trials of 2 GPUs at once get cuda:0,1 and cuda:2,3."""
    import argparse

    import torch

    from paratrain import config, session
    from paratrain.search import command, runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = argparse.Namespace(parallel=None, devices_per_trial=2)
    accelerator, gpus, parallel, threads = command._pool_size(args, config.TrainConfig())
    assert (accelerator, gpus, parallel) == ("gpu", 4, 2)
    slots = command.device_plan(accelerator, parallel, 2, threads)["slots"]
    assert slots == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    planned = []
    monkeypatch.setattr(session, "run", lambda *a, devices, **_: planned.append(devices) or {})  # the trial's run
    cfg = config.TrainConfig(out=str(tmp_path))
    for index in (0, 1):  # what the pool's two processes run
        runner.train_one(cfg, None, index, threads, accelerator, 2)
    assert [list(d) for d in planned] == slots


def test_a_fixed_pipeline_is_checked_against_the_devices_of_a_trial(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main

    path = _space_file(tmp_path, "fixed: {model: mlp, dataset: digits, strategy: pipeline, stages: 2}\n"
                                 "params:\n  lr: [0.01, 0.003]\n")
    code = main(["search", "--space", path, "--out", str(tmp_path / "o"), "--devices-per-trial", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "--stages 2 needs --devices 2, not 3" in err, err
    code = main(["search", "--space", _space_file(tmp_path), "--out", str(tmp_path / "o"), "--strategy", "rings"])
    assert code == 2 and "unknown --strategy 'rings'" in capsys.readouterr().err


@pytest.mark.integration
# hybrid trials run as pipeline trials do, on more devices (the hybrid layout itself: test_pipeline.py)
@pytest.mark.parametrize(("strategy", "flags"), [("pipeline", []), ("fsdp", ["--devices-per-trial", "2"])])
def test_pipeline_hybrid_and_fsdp_trials_equal_the_same_run_alone(tmp_path: Path, strategy: str,
                                                                  flags: list[str]) -> None:
    import torch

    from paratrain.checkpoint import files as checkpoint

    stages = ", stages: 2" if strategy != "fsdp" else ""
    path = _space_file(tmp_path, f"fixed: {{model: mlp, dataset: digits, strategy: {strategy}{stages}}}\n"
                                 "params:\n  lr: [0.01, 0.003]\n")
    proc = run_cli("search", "--space", path, "--sampler", "grid", "--out", str(tmp_path / "s"), "--parallel", "1",
                   "--steps", "10", "--batch-size", "32", "--microbatches", "2", "--oversubscribe", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_complete(tmp_path / "s")) == 2  # a pipeline space trains (it once divided by zero)
    # best.yaml holds the trial's devices (and the search's --oversubscribe)
    train_here(tmp_path / "alone", "--config", str(tmp_path / "s" / "best.yaml"))
    best_lr = yaml.safe_load((tmp_path / "s" / "best.yaml").read_text())["lr"]
    best = next(r for r in _complete(tmp_path / "s") if float(r["lr"]) == float(best_lr))
    trial = checkpoint.load(tmp_path / "s" / "trials" / f"{int(best['number']):04d}")["model"]
    mine = checkpoint.load(tmp_path / "alone")["model"]
    assert max(float((trial[k] - mine[k]).abs().max()) for k in mine) == 0.0
    assert torch.is_tensor(next(iter(mine.values())))


@pytest.mark.integration
def test_a_nan_trial_on_two_workers_fails_alone_and_is_not_trained_again(tmp_path: Path) -> None:
    path = _space_file(tmp_path, "fixed: {model: mlp, dataset: digits, optimizer: sgd}\n"
                                 "params:\n  lr: [1.0e+8, 0.01]\n")
    args = ("search", "--space", path, "--sampler", "grid", "--devices-per-trial", "2", "--parallel", "1",
            "--out", str(tmp_path / "s"), "--steps", "20")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    with open(tmp_path / "s" / "trials.csv") as f:
        rows = {r["lr"]: r for r in csv.DictReader(f)}
    assert rows["100000000.0"]["state"] == "FAIL" and "the loss became nan" in rows["100000000.0"]["error"]
    assert rows["0.01"]["state"] == "COMPLETE"
    again = run_cli(*args)  # the same search again: both points are done, the failed one with its reason
    assert again.returncode == 0 and "2 trials (2 already done)" in again.stdout, again.stderr[-3000:]
    with open(tmp_path / "s" / "trials.csv") as f:
        assert [r["worker"] for r in csv.DictReader(f)] == [r["worker"] for r in rows.values()]  # none trained again


def test_a_tower_trial_drives_the_gpus_of_its_pool_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pool process 1 of trials on 2 (faked) GPUs: its tower keeps the parameters on cuda:2 and its replicas
    on cuda:2 and cuda:3, with the threads of its share of the cores."""
    from paratrain import config
    from paratrain.data import load_dataset
    from paratrain.parallel import runplan, strategies
    from paratrain.runtime.devices import Hardware

    cfg = config.validate(config.TrainConfig(strategy="tower", out=str(tmp_path), devices="2", steps=1))
    data = load_dataset("digits")
    cfg = strategies.checked(cfg)
    plan = runplan.make(cfg, lambda: data, hardware=Hardware("gpu", 2, 1, "nccl"), devices=("cuda:2", "cuda:3"))
    assert plan.devices == ("cuda:2",) and plan.layout.replicas == ("cuda:2", "cuda:3")
    assert plan.hardware.workers == 1 and plan.hardware.threads_per_worker == 2


@pytest.mark.integration
@pytest.mark.parametrize("per_trial", ["1", "2"])
def test_pruned_trials_are_marked_keep_their_curve_and_never_win(tmp_path: Path, per_trial: str) -> None:
    """Ten learning rates, seven of them too small to learn: once five trials are done, the median pruner
    stops those below the median at their first epochs. (Three learners: the grid's order puts two of them among
    the first five, so the median the pruner compares with is a non-learner's whatever pace the learners keep;
    with five learners, three came first, and a learner slower than their median was pruned.)"""
    lrs = [1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6, 1e-3, 2e-3, 3e-3]
    path = _space_file(tmp_path, f"fixed: {{model: mlp, dataset: digits}}\nparams:\n  lr: {lrs}\n")
    proc = run_cli("search", "--space", path, "--sampler", "grid", "--pruner", "median", "--parallel", "1",
                   "--devices-per-trial", per_trial, "--epochs", "3", "--batch-size", "64",
                   "--out", str(tmp_path / "s"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "s" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    pruned = [r for r in rows if r["state"] == "PRUNED"]
    assert pruned and all(float(r["lr"]) <= 1e-6 for r in pruned), rows  # the learning ones run on
    assert all(r["val_accuracy"] for r in pruned)  # the last accuracy of its partial curve
    best = yaml.safe_load((tmp_path / "s" / "summary.yaml").read_text())
    assert best["pruned"] == len(pruned) and best["best_trial"] not in {int(r["number"]) for r in pruned}
    import optuna  # the study stays Optuna's own: its tools read it, curves and all

    study = optuna.load_study(study_name="search", storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    trials = {t.number: t for t in study.get_trials()}
    assert all(trials[int(r["number"])].state.name == "PRUNED" and trials[int(r["number"])].intermediate_values
               for r in pruned)


@pytest.mark.integration
def test_a_trial_that_kills_its_process_is_tried_once_more_then_failed(tmp_path: Path) -> None:
    """A one-device trial runs inside its pool process: killed there (as the out-of-memory killer would), the
    search starts a new process, tries the trial once more, fails it when that dies too, and goes on."""
    import optuna

    from paratrain.search.study import storage

    path = _space_file(tmp_path, "fixed: {model: mlp, dataset: digits}\nparams:\n  lr: [0.001, 0.003, 0.01]\n")
    out = tmp_path / "s"
    search = subprocess.Popen([sys.executable, "-m", "paratrain", "search", "--space", path, "--sampler", "grid",
                               "--parallel", "1", "--steps", "1000", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: list[tuple[int, float]] = []  # (trial, lr): the first trial seen running, then its second try
    deadline = time.monotonic() + 300
    while len(killed) < 2 and time.monotonic() < deadline and search.poll() is None:
        time.sleep(0.2)
        try:
            # the search makes the tables: a probe that made them too raced it ("table ... already exists"); what
            # it may still write (Optuna's version row) the search's retry covers
            trials = optuna.load_study(study_name="search", storage=storage(f"sqlite:///{out / 'study.db'}",
                                                                            create_tables=False)).get_trials()
        except Exception:  # noqa: BLE001 (not created yet, or busy)
            continue
        for t in trials:
            wanted = not killed or (t.params.get("lr") == killed[0][1] and t.number != killed[0][0])
            if t.state.name == "RUNNING" and "worker" in t.user_attrs and wanted:
                os.kill(int(t.user_attrs["worker"].rsplit(":", 1)[1]), signal.SIGKILL)
                killed.append((t.number, t.params["lr"]))
                break
    stdout, stderr = search.communicate(timeout=600)
    assert len(killed) == 2 and search.returncode == 0, stderr[-3000:]
    assert stderr.count("died (killed by SIGKILL)") == 2
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    lost = [r for r in rows if float(r["lr"]) == killed[0][1]]
    assert [r["state"] for r in lost] == ["FAIL", "FAIL"] and "queued again" in lost[0]["error"]
    assert "died twice" in lost[1]["error"]
    assert sorted(float(r["lr"]) for r in rows if r["state"] == "COMPLETE") == sorted(
        {0.001, 0.003, 0.01} - {killed[0][1]})  # the search went on and trained the others


def test_a_proposal_of_a_finished_point_reuses_its_value_and_is_no_training(tmp_path: Path) -> None:
    import optuna

    from paratrain.search import report, runner
    from paratrain.search import study as studies

    study = optuna.create_study(direction="maximize")
    first = study.ask({"lr": optuna.distributions.CategoricalDistribution([0.1, 0.2])})
    first.set_user_attr("params", {"lr": 0.1})
    first.set_user_attr("train_time_s", 1.0)
    study.tell(first, 0.75)
    running = study.ask({"lr": optuna.distributions.CategoricalDistribution([0.1, 0.2])})
    assert runner.finished_value(study, first.number) == 0.75 and runner.finished_value(study, running.number) is None
    again = study.ask({"lr": optuna.distributions.CategoricalDistribution([0.1, 0.2])})
    for key, value in (("duplicate_of", first.number), ("reused", first.number), ("params", {"lr": 0.1})):
        again.set_user_attr(key, value)
    study.tell(again, 0.75)  # what the objective returns for it
    assert studies.counts(study)[0] == 1  # one training finished: the reused one takes no place in the budget
    summary = report.write(study, {}, tmp_path, 1.0)
    assert summary["reused"] == 1 and summary["complete"] == 1 and summary["best_trial"] == first.number
    with open(tmp_path / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["state"], r["reused"]) for r in rows] == [("COMPLETE", ""), ("RUNNING", ""),
                                                         ("COMPLETE", f"trial {first.number}")]


def test_best_yaml_leaves_out_what_the_best_trials_optimizer_does_not_read(tmp_path: Path) -> None:
    """A space that draws the optimizer and the momentum: the best trial ran Adam, so best.yaml holds no
    momentum (`paratrain train --config best.yaml` would warn of it); an SGD trial's would keep it."""
    import optuna

    from paratrain.search import report

    choices = {"optimizer": optuna.distributions.CategoricalDistribution(["adam", "sgd"]),
               "momentum": optuna.distributions.CategoricalDistribution([0.5, 0.8])}
    study = optuna.create_study(direction="maximize")
    for optimizer, value in (("adam", 0.9), ("sgd", 0.7)):
        trial = study.ask(choices)
        trial.set_user_attr("params", {"optimizer": optimizer, "momentum": 0.5})
        trial.set_user_attr("train_time_s", 1.0)
        study.tell(trial, value)
    report.write(study, {"model": "mlp", "steps": 3}, tmp_path, 1.0)
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best == {"model": "mlp", "steps": 3, "optimizer": "adam"}
    trial = study.ask(choices)  # an SGD trial wins: its momentum is read, and stays
    trial.set_user_attr("params", {"optimizer": "sgd", "momentum": 0.5})
    trial.set_user_attr("train_time_s", 1.0)
    study.tell(trial, 0.95)
    report.write(study, {"model": "mlp", "steps": 3}, tmp_path, 1.0)
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best == {"model": "mlp", "steps": 3, "optimizer": "sgd", "momentum": 0.5}


def test_a_space_may_fix_any_train_option_the_search_does_not_set_itself(tmp_path: Path) -> None:
    sp = space.parse({"fixed": {"dataset": "mnist", "data-dir": str(tmp_path), "download": False,
                                "max_restarts": 1, "log_every": 5}, "params": {"lr": [0.01, 0.02]}})
    assert sp.fixed["data_dir"] == str(tmp_path) and sp.fixed["download"] is False
    from paratrain.search.command import NOT_TRAIN_FLAGS

    # what the search sets itself is named, with the flag of the search that sets it
    assert {*space.SET_BY_SEARCH, *space.FIXED_BY_SEARCH} >= NOT_TRAIN_FLAGS - {"strategy"}
    assert space.parse({"params": {"seed": [0, 1]}}).params[0].name == "seed"  # a seed sweep
    with pytest.raises(UserError, match="cannot fix 'seed'"):
        space.parse({"fixed": {"seed": 1}, "params": {"lr": [0.01, 0.02]}})


def test_without_scikit_learn_a_search_says_why_it_draws_no_importance(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Optuna's fANOVA fits scikit-learn's forest; scikit-learn is no dependency of paratrain's."""
    import importlib.util

    from paratrain.search import report

    real = importlib.util.find_spec
    from paratrain.core import optional as extras

    monkeypatch.setattr(extras, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    (tmp_path / "importance.png").write_bytes(b"an earlier start's")
    found, why = report._plot_importance(object(), 30, 2, tmp_path / "importance.png")
    assert found is None and why == ("no parameter importance: Optuna's fANOVA needs scikit-learn, which is not "
                                     "installed (pip install 'paratrain[search]' (or 'paratrain[all]'))")
    assert not (tmp_path / "importance.png").exists()
