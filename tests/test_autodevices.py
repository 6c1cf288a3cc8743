"""`--devices auto` on CPUs measures the run's own network on one worker and on more, and takes the faster
(autodevices.py): the decision on given rates, what is not measured (a short run, a run too short to repay
starting workers), the cache, an explicit --devices N far below one worker, and real measurements."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from paratrain import config as C
from paratrain.data import load_dataset
from paratrain.measure import autodevices
from paratrain.parallel import runplan, strategies
from paratrain.runtime.devices import Hardware
from paratrain.runtime.env import LOCAL, Environment

# its integration tests bound wall times or compare measured rates: .ci/run runs them with nothing beside
pytestmark = pytest.mark.alone

DIGITS = load_dataset("digits")


def plan_of(tmp_path: Path, **changes: object) -> runplan.RunPlan:
    cfg = C.validate(C.TrainConfig(dataset="digits", out=str(tmp_path / "run"), **changes))
    return runplan.make(strategies.checked(cfg), lambda: DIGITS, hardware=autodevices.cpu_workers(1))


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[int, float]:
    """Stand-in rates per worker count; the list of layouts measured. A cache of its own: a run of an earlier
    test (any --devices auto run of the same network and batch) must not have answered already."""
    monkeypatch.setenv("PARATRAIN_DEVICES_CACHE", str(tmp_path / "measured-devices.json"))
    rates: dict[int, float] = {}
    calls: list[int] = []
    monkeypatch.setattr(autodevices, "measure", lambda plan, hw: calls.append(hw.workers) or rates[hw.workers])
    monkeypatch.setattr(autodevices, "usable_cores", lambda: 2)
    rates["calls"] = calls  # type: ignore[assignment]
    return rates


def test_it_applies_to_data_parallel_cpu_runs_whose_layout_is_not_given() -> None:
    cfg = C.TrainConfig(accelerator="cpu")
    two_cores = autodevices.usable_cores() > 1
    assert autodevices.applies(cfg, LOCAL, None) == two_cores
    for given in ({"devices": "2"}, {"devices": "1"}, {"threads_per_worker": 1}, {"batch_per_worker": 32},
                  {"strategy": "pipeline"}, {"oversubscribe": True}):
        assert not autodevices.applies(cfg.replace(**given), LOCAL, None), given
    assert not autodevices.applies(cfg, LOCAL, Hardware("cpu", 1, 1, "gloo"))  # a search trial's share
    torchrun = Environment("torchrun", 0, 2, 0, 2, 0)
    assert not autodevices.applies(cfg, torchrun, None)


def test_candidates_split_the_batch_evenly() -> None:
    assert autodevices.candidates(2, 64) == [2]
    assert autodevices.candidates(2, 63) == []
    assert autodevices.candidates(8, 64) == [2, 4, 8]
    assert autodevices.candidates(6, 60) == [2, 4, 6]
    assert autodevices.candidates(32, 64) == [2, 4, 8]


def test_the_faster_layout_is_chosen_and_kept(tmp_path: Path, measured: dict) -> None:
    plan = plan_of(tmp_path, steps=100_000)
    measured.update({1: 700.0, 2: 276.0})  # a ResNet-18 at batch 64 on 2 cores
    chosen, choice = autodevices.choose(plan, 100_000)
    assert chosen.hardware == Hardware("cpu", 1, 2, "gloo") and choice["workers"] == 1
    assert measured["calls"] == [1, 2] and choice["rates"] == {"1": 700.0, "2": 276.0} and not choice["cached"]
    line = autodevices.line(choice)
    assert "1 worker x 2 threads, 700 examples/s against 276 on 2 workers x 1 thread" in line
    # the second run of this network and batch measures nothing
    measured["calls"].clear()
    _, again = autodevices.choose(plan, 100_000)
    assert measured["calls"] == [] and again["cached"] and again["workers"] == 1
    assert "from earlier measurements" in autodevices.line(again)


def test_two_workers_are_chosen_where_they_are_faster(tmp_path: Path, measured: dict) -> None:
    plan = plan_of(tmp_path, steps=100_000, batch_size=128)  # another key than the test above
    measured.update({1: 1000.0, 2: 1800.0})
    chosen, choice = autodevices.choose(plan, 100_000)
    assert chosen.hardware == Hardware("cpu", 2, 1, "gloo") and chosen.devices == ("cpu", "cpu")
    assert choice["workers"] == 2 and measured["calls"] == [1, 2, 1]  # one worker measured again, undisturbed
    # within the margin, the fewer processes win
    plan = plan_of(tmp_path, steps=100_000, batch_size=32)
    measured.update({1: 1000.0, 2: 1020.0})
    assert autodevices.choose(plan, 100_000)[1]["workers"] == 1


def test_a_disturbed_first_measurement_of_one_worker_does_not_choose_workers_that_lose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first 1-worker measurement runs as the forkserver imports torch beside it: measured again after
    the workers, the faster of the two counts."""
    ones = iter([167.0, 5000.0])
    monkeypatch.setattr(autodevices, "measure", lambda plan, hw: next(ones) if hw.workers == 1 else 3874.0)
    monkeypatch.setattr(autodevices, "usable_cores", lambda: 2)
    chosen, choice = autodevices.choose(plan_of(tmp_path, steps=100_000, batch_size=96), 100_000)
    assert chosen.hardware.workers == 1 and choice["rates"] == {"1": 5000.0, "2": 3874.0}


def test_a_run_too_short_to_repay_starting_workers_does_not_measure_them(tmp_path: Path, measured: dict) -> None:
    plan = plan_of(tmp_path, batch_size=16)
    measured.update({1: 5000.0, 2: 9000.0})
    _, choice = autodevices.choose(plan, 200)  # 200 steps of 16 at 5,000/s: well under a second
    assert measured["calls"] == [1] and choice["workers"] == 1
    assert choice["not_measured"]["workers"] == 2
    assert "2 workers not tried: a run of about 1 s would not repay" in autodevices.line(choice)
    # fewer steps than measuring takes: nothing is measured at all
    measured["calls"].clear()
    plan = plan_of(tmp_path, batch_size=48)
    chosen, choice = autodevices.choose(plan, 20)
    assert measured["calls"] == [] and chosen.hardware.workers == 1 and choice["rates"] == {}


def test_an_explicit_count_far_below_one_worker_is_said_once(tmp_path: Path, measured: dict) -> None:
    plan = plan_of(tmp_path, batch_size=24)
    autodevices.remember(autodevices.cache_key(plan), {1: 900.0})
    two = runplan.with_hardware(plan, Hardware("cpu", 2, 1, "gloo"))
    note = autodevices.far_below(two, {"examples_per_sec": 300.0, "steps": 200, "resumed_from_step": None})
    assert note is not None and "2 workers trained at 300 examples/s, 0.33x one worker's 900" in note
    assert "--devices 1 is faster" in note
    # and the run's own rate is kept for later choices
    assert autodevices.cached_rates(autodevices.cache_key(plan)) == {1: 900.0, 2: 300.0}
    assert autodevices.far_below(two, {"examples_per_sec": 800.0, "steps": 200, "resumed_from_step": None}) is None


def test_an_unreadable_cache_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_DEVICES_CACHE", str(tmp_path / "devices.json"))
    (tmp_path / "devices.json").write_text("{not json")
    assert autodevices.cached_rates("abc") == {}
    autodevices.remember("abc", {1: 10.0})
    assert json.loads((tmp_path / "devices.json").read_text())["abc"]["rates"] == {"1": 10.0}


@pytest.mark.integration
def test_real_measurements_on_one_and_two_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layouts measured for real (one in this process, two spawned): both rates, the faster chosen, and
    the scratch folders gone; a real run's summary records the choice."""
    if autodevices.usable_cores() < 2:
        pytest.skip("one core here: there is no layout to choose")
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(**kwargs: str) -> str:  # each measurement's run folder, recorded
        made.append(Path(real_mkdtemp(**kwargs)))
        return str(made[-1])

    monkeypatch.setattr(autodevices.tempfile, "mkdtemp", mkdtemp)
    plan = plan_of(tmp_path, batch_size=80)
    chosen, choice = autodevices.choose(plan, 10**6)
    rates = {int(n): r for n, r in choice["rates"].items()}
    assert set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    faster = 2 if rates[2] >= autodevices.MARGIN * rates[1] else 1
    assert chosen.hardware.workers == choice["workers"] == faster
    ours = [p for p in made if p.name.startswith("paratrain-devices-")]  # (multiprocessing makes its own)
    assert len(ours) in (2, 3)  # 1 and 2 workers, and 1 again where 2 were faster at first
    assert not any(p.exists() for p in ours)  # each measurement's run folder is removed
    from conftest import run_cli

    proc = run_cli("train", "--out", str(tmp_path / "cli"), "--steps", "30")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "paratrain: --devices auto: 1 worker x" in proc.stderr
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["devices_auto"]["workers"] == 1 == summary["world_size"]
