"""Fault tolerance, tested the way the trusted systems test it: by stopping and killing workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive, descendants, max_abs_diff, train, weights

from paratrain import checkpoint

pytestmark = pytest.mark.integration


def _launch(run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--quiet", "--no-tensorboard", "--out",
                             str(run), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _workers(launcher: subprocess.Popen) -> list[int]:
    """The launcher's spawned training workers (not multiprocessing's resource tracker)."""
    found = []
    for pid in descendants(launcher.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


def _finish(launcher: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        code = launcher.wait(timeout=timeout)
    finally:
        launcher.kill()
    return code, launcher.stderr.read()


def test_sigterm_stops_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "2", "--epochs", "1000", "--log-every", "5")
    _wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
    workers = _workers(launcher)
    assert len(workers) == 2
    start = time.time()
    launcher.send_signal(signal.SIGTERM)
    code, stderr = _finish(launcher, timeout=20)
    assert code == 143 and time.time() - start < 10, stderr
    assert "stopped by SIGTERM at step" in stderr and "--resume" in stderr and "Traceback" not in stderr
    time.sleep(0.5)
    assert [p for p in workers if alive(p)] == []
    state = checkpoint.load(run / "checkpoints" / "last.pt")
    assert state["step"] >= 10  # the work up to the stop was saved
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--resume", str(run), "--epochs",
                           str(state["epoch"] + 2)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] > state["step"]


def test_sigint_in_one_process_saves_and_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "1", "--epochs", "1000", "--log-every", "5")
    _wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
    launcher.send_signal(signal.SIGINT)
    code, stderr = _finish(launcher, timeout=10)
    assert code == 130 and "stopped by SIGINT" in stderr, stderr
    assert checkpoint.load(run / "checkpoints" / "last.pt")["step"] >= 10


def test_stopped_worker_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP one worker: the other waits in a collective, gives up after --collective-timeout, names the
    silent rank, and no process of the run remains."""
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "2", "--epochs", "1000", "--log-every", "5", "--collective-timeout", "5")
    _wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
    workers = _workers(launcher)
    every = [launcher.pid, *descendants(launcher.pid)]
    start = time.time()
    os.kill(workers[1], signal.SIGSTOP)
    try:
        code, stderr = _finish(launcher, timeout=5 + 30)
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert code == 1 and time.time() - start < 5 + 30, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("paratrain:")]
    assert any("stopped answering" in line and "rank 1" in line for line in lines), stderr
    time.sleep(1)
    assert [p for p in every if alive(p)] == []


def test_resuming_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    """--resume of a run that has all its steps: evaluate, write the summary, exit 0 (it once crashed)."""
    train(tmp_path / "run", "--steps", "5", "--devices", "1", "--no-tensorboard")
    before = weights(tmp_path / "run")
    summary = train(tmp_path / "run", "--resume", str(tmp_path / "run"))
    assert summary["steps"] == 5 and summary["examples_per_sec"] is None
    assert max_abs_diff(before, weights(tmp_path / "run")) == 0


def test_resume_with_fewer_workers(tmp_path: Path) -> None:
    """The global batch does not depend on the worker count, so a run saved by 2 workers goes on with 1."""
    args = ("--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64", "--no-tensorboard")
    train(tmp_path / "run", *args, "--steps", "10", "--devices", "2")
    train(tmp_path / "run", "--resume", str(tmp_path / "run"), "--steps", "20", "--devices", "1")
    train(tmp_path / "one", *args, "--steps", "20", "--devices", "1")
    assert max_abs_diff(weights(tmp_path / "run"), weights(tmp_path / "one")) < 1e-4


@pytest.mark.slow
def test_killed_worker_restarts_from_the_checkpoint(tmp_path: Path, mnist_dir: Path) -> None:
    """kill -9 one of 2 workers in epoch 2 of 3 with --max-restarts 1: the run finishes, records the
    restart, and ends with the weights of a run nobody touched (Adam, the default)."""
    args = ("--dataset", "mnist", "--data-dir", str(mnist_dir), "--epochs", "3", "--devices", "2",
            "--checkpoint-every", "20", "--log-every", "5")
    whole = train(tmp_path / "whole", *args, "--no-tensorboard")
    run = tmp_path / "killed"
    launcher = _launch(run, *args, "--max-restarts", "1")
    per_epoch = 55_000 // 512
    _wait_for(lambda: any(r.get("step", 0) >= per_epoch + 30 for r in _records(run)), 300, "epoch 2")
    workers = _workers(launcher)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    code, stderr = _finish(launcher, timeout=600)
    assert code == 0, stderr
    assert "restarting all workers from the last checkpoint (restart 1 of 1)" in stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == whole["steps"]
    assert summary["test_accuracy"] == whole["test_accuracy"]
    assert max_abs_diff(weights(run), weights(tmp_path / "whole")) <= 1e-6


def test_a_torchrun_restart_carries_on_from_the_checkpoint(tmp_path: Path) -> None:
    """torchrun --max-restarts starts the workers again with TORCHELASTIC_RESTART_COUNT set: they find the
    checkpoint in --out and go on from it (here one worker, in the environment torchrun would give it)."""
    args = ("--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64", "--no-tensorboard", "--devices", "1")
    train(tmp_path / "run", *args, "--steps", "10")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577", "TORCHELASTIC_RESTART_COUNT": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "run"),
                           *args, "--steps", "20"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "carrying on from the checkpoint of step 10 found in" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == 20 and summary["resumed_from_step"] == 10
    train(tmp_path / "whole", *args, "--steps", "20")
    assert max_abs_diff(weights(tmp_path / "run"), weights(tmp_path / "whole")) < 1e-4
    # A checkpoint of another model in --out is one line and exit 2, not a resume or a traceback.
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "run"),
                           *args, "--model", "mlp"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "is of model 'lenet5', not 'mlp'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
