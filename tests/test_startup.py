"""Where a run's time goes before its first step and after its last (summary.json), and the forkserver that
workers start from: as fresh as a spawned worker (the launcher's environment and streams at the launch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import main_code, run_cli

import paratrain
from paratrain import clock, prefork

STARTUP = {"imports", "data", "plan", "spawn", "join", "build", "first_step"}


def test_one_workers_summary_says_where_the_start_up_went(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_code(["train", "--devices", "1", "--steps", "3", "--quiet", "--time-phases", "--no-tensorboard",
                      "--out", str(tmp_path / "run")]) == 0
    table = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    startup, finish = summary["startup_s"], summary["finish_s"]
    assert set(startup) == STARTUP and set(finish) == set(clock.FINISH)
    assert all(v is not None and v >= 0 for v in (*startup.values(), *finish.values()))
    assert startup["spawn"] < 0.05 and startup["join"] < 0.05  # one worker: in this process, no group
    assert summary["first_step_at_s"] >= startup["data"] + startup["build"]
    for phase in (*STARTUP, *clock.FINISH):
        assert f"\n{phase:<12} " in table
    assert "the first step started" in table


def test_process_start_is_before_now_and_after_boot() -> None:
    import time

    started = clock.process_start()
    assert 0 < time.time() - started < 24 * 3600 * 365  # this test process started in the past
    assert clock.startup({"process_start": 1.0, "train_called": 3.0, "data_s": 0.5, "launched": 4.0}) == {
        "imports": 2.0, "data": 0.5, "plan": 0.5, "spawn": None, "join": None, "build": None, "first_step": None}


def test_the_forkserver_is_warmed_only_where_workers_will_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert not prefork.worth_warming("1")
    assert prefork.worth_warming("2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert not prefork.worth_warming("auto") and prefork.worth_warming("2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not prefork.worth_warming("2")  # torchrun started this worker
    monkeypatch.setenv("PARATRAIN_START_METHOD", "spawn")
    assert prefork.start_method() == "spawn"


@pytest.mark.integration
def test_the_main_job_on_two_workers_reports_every_phase_and_ends_without_a_warning(tmp_path: Path) -> None:
    proc = run_cli("train", "--steps", "20", "--out", str(tmp_path / "run"), "--time-phases")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr  # nothing at exit
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert all(summary["startup_s"][p] is not None for p in STARTUP)
    assert summary["finish_s"]["shutdown"] is not None and summary["startup_s"]["spawn"] > 0
    assert "the first step started" in proc.stdout


def needs_the_variable(channels: int, image_size: int, num_classes: int) -> object:
    """A network factory that fails unless the launcher's environment at the launch reached the worker."""
    from torch import nn

    if os.environ.get("PARATRAIN_TEST_SET_AFTER_THE_FORKSERVER") != "yes":
        raise RuntimeError("the worker did not get the launcher's environment")
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size**2, num_classes))


@pytest.mark.integration
def test_workers_see_the_environment_of_the_launch_not_of_the_forkservers_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    prefork.warm_up()  # started before the variable is set (as by an earlier run in this process)
    monkeypatch.setenv("PARATRAIN_TEST_SET_AFTER_THE_FORKSERVER", "yes")
    summary = paratrain.fit(needs_the_variable, "digits", paratrain.TrainConfig(
        devices="2", steps=2, batch_size=32, out=str(tmp_path / "run"), tensorboard=False))
    assert summary["world_size"] == 2
    assert "test_accuracy" in capfd.readouterr().out  # the launcher's streams as pytest captures them now
