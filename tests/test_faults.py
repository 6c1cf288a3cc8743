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
from conftest import alive, crashing_model, descendants, max_abs_diff, train_here, training_workers, wait_for, weights

from paratrain.checkpoint import files as checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # wall-time bounds: .ci/run runs it alone


def _launch(run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--quiet", "--no-tensorboard", "--out",
                             str(run), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _workers(launcher: subprocess.Popen) -> list[int]:
    """The launcher's training workers (not its forkserver nor multiprocessing's resource tracker)."""
    return training_workers(launcher.pid)


def _finish(launcher: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        code = launcher.wait(timeout=timeout)
    finally:
        launcher.kill()
    return code, launcher.stderr.read()


def test_sigterm_stops_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "2", "--epochs", "1000", "--log-every", "5")
    wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
    workers = _workers(launcher)
    assert len(workers) == 2
    # each worker names its rank for ps, top and pgrep (its command line is its forkserver's)
    assert sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in workers) == ["paratrain-w0", "paratrain-w1"]
    start = time.time()
    launcher.send_signal(signal.SIGTERM)
    code, stderr = _finish(launcher, timeout=20)
    assert code == 143 and time.time() - start < 10, stderr
    assert "stopped by SIGTERM at step" in stderr and "--resume" in stderr and "Traceback" not in stderr
    time.sleep(0.5)
    assert [p for p in workers if alive(p)] == []
    state = checkpoint.load(run)
    assert state["step"] >= 10  # the work up to the stop was saved
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--resume", str(run), "--epochs",
                           str(state["epoch"] + 2)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] > state["step"]


def test_sigint_in_one_process_saves_and_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "1", "--epochs", "1000", "--log-every", "5")
    wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
    launcher.send_signal(signal.SIGINT)
    code, stderr = _finish(launcher, timeout=10)
    assert code == 130 and "stopped by SIGINT" in stderr, stderr
    assert checkpoint.load(run)["step"] >= 10


def test_stopped_worker_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP one worker: the other waits in a collective, gives up after --collective-timeout, names the
    silent rank, and no process of the run remains."""
    run = tmp_path / "run"
    launcher = _launch(run, "--devices", "2", "--epochs", "1000", "--log-every", "5", "--collective-timeout", "5")
    wait_for(lambda: len(_records(run)) >= 2, 120, "training to start")
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
    _none_left(every)


def test_resuming_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    """--resume of a run that has all its steps: evaluate, write the summary, exit 0 (it once crashed)."""
    first = train_here(tmp_path / "run", "--steps", "5", "--devices", "1", "--no-tensorboard")
    before = weights(tmp_path / "run")
    summary = train_here(tmp_path / "run", "--resume", str(tmp_path / "run"))
    # the training's figures are the first start's (this one trained nothing)
    assert summary["steps"] == 5 and summary["examples_per_sec"] == first["examples_per_sec"]
    assert max_abs_diff(before, weights(tmp_path / "run")) == 0


def test_resume_with_fewer_workers(tmp_path: Path) -> None:
    """The global batch does not depend on the worker count, so a run saved by 2 workers goes on with 1."""
    args = ("--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64", "--no-tensorboard")
    train_here(tmp_path / "run", *args, "--steps", "10", "--devices", "2")
    train_here(tmp_path / "run", "--resume", str(tmp_path / "run"), "--steps", "20", "--devices", "1")
    train_here(tmp_path / "one", *args, "--steps", "20", "--devices", "1")
    assert max_abs_diff(weights(tmp_path / "run"), weights(tmp_path / "one")) < 5e-6  # measured 4.5e-8


@pytest.mark.slow
def test_killed_worker_restarts_from_the_checkpoint(tmp_path: Path, mnist_dir: Path) -> None:
    """kill -9 one of 2 workers in epoch 2 of 3 with --max-restarts 1: the run finishes, records the
    restart, and ends with the weights of a run nobody touched (Adam, the default)."""
    args = ("--dataset", "mnist", "--data-dir", str(mnist_dir), "--epochs", "3", "--devices", "2",
            "--checkpoint-every", "20", "--log-every", "5")
    whole = train_here(tmp_path / "whole", *args, "--no-tensorboard")
    run = tmp_path / "killed"
    launcher = _launch(run, *args, "--max-restarts", "1")
    per_epoch = 55_000 // 512
    wait_for(lambda: any(r.get("step", 0) >= per_epoch + 30 for r in _records(run)), 300, "epoch 2")
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


def test_a_worker_in_a_restart_environment_carries_on_from_the_checkpoint(tmp_path: Path) -> None:
    """torchrun --max-restarts starts the workers again with TORCHELASTIC_RESTART_COUNT set: they find the
    checkpoint in --out and go on from it. Here one worker is started in that environment by hand (no
    torchrun; the next test starts torchrun itself)."""
    args = ("--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64", "--no-tensorboard", "--devices", "1")
    train_here(tmp_path / "run", *args, "--steps", "10")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29577", "TORCHELASTIC_RESTART_COUNT": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "run"),
                           *args, "--steps", "20"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "carrying on from the checkpoint of step 10 found in" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == 20 and summary["resumed_from_step"] == 10
    train_here(tmp_path / "whole", *args, "--steps", "20")
    assert max_abs_diff(weights(tmp_path / "run"), weights(tmp_path / "whole")) < 1e-6  # measured 0.0
    # A checkpoint of another model in --out is one line and exit 2, not a resume or a traceback.
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "run"),
                           *args, "--model", "mlp"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "is of model 'lenet5', not 'mlp'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _started(run: Path, launcher: subprocess.Popen, step: int = 3) -> list[int]:
    """Wait until the run has logged `step`, and return its two workers."""
    wait_for(lambda: any(r.get("step", 0) >= step for r in _records(run)), 120, f"step {step}")
    workers = _workers(launcher)
    assert len(workers) == 2, workers
    return workers


LONG = ("--devices", "2", "--epochs", "1000", "--log-every", "1", "--checkpoint-every", "5")


def _signal_a_worker(run: Path, signum: int) -> tuple[int, str, list[int]]:
    """A long 2-worker run whose second worker gets `signum` once it trains: the launcher's exit code and
    stderr, and the workers."""
    launcher = _launch(run, *LONG)
    workers = _started(run, launcher)
    os.kill(workers[1], signum)
    code, stderr = _finish(launcher, timeout=60)
    return code, stderr, workers


def _none_left(pids: list[int]) -> None:
    time.sleep(1)  # a moment for the kernel to reap them
    assert [p for p in pids if alive(p)] == []


def test_a_dead_worker_without_restarts_ends_the_run_with_exit_1(tmp_path: Path) -> None:
    code, stderr, workers = _signal_a_worker(tmp_path / "run", signal.SIGKILL)
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and "died" in last and "--max-restarts 1 (or more) restarts the run" in last, stderr
    _none_left(workers)


def test_restarts_used_up_end_the_run_with_exit_1(tmp_path: Path) -> None:
    """--max-restarts 1: the first death is mended, the second ends the run."""
    run = tmp_path / "run"
    launcher = _launch(run, *LONG, "--max-restarts", "1")
    first = _started(run, launcher)
    os.kill(first[0], signal.SIGKILL)
    wait_for(lambda: len(set(_workers(launcher)) - set(first)) == 2, 60, "the restarted workers")
    # a death before the first checkpoint (step 5) restarts from scratch, with the log emptied
    second = _started(run, launcher, step=max((r.get("step", 0) for r in _records(run)), default=0) + 2)
    assert not set(second) & set(first)
    os.kill(second[1], signal.SIGKILL)
    code, stderr = _finish(launcher, timeout=60)
    assert code == 1, stderr
    assert "restarting all workers from the last checkpoint (restart 1 of 1)" in stderr
    assert "the run stopped" in stderr.strip().splitlines()[-1], stderr


def test_a_worker_that_cannot_stop_is_killed_after_8_s(tmp_path: Path) -> None:
    """SIGTERM to the launcher while one worker is frozen (SIGSTOP: it cannot finish its step or save):
    the launcher waits STOP_WAIT_S = 8 s, kills it, and exits 143 with no process left."""
    run = tmp_path / "run"
    launcher = _launch(run, *LONG)
    workers = _started(run, launcher)
    os.kill(workers[1], signal.SIGSTOP)
    start = time.time()
    launcher.send_signal(signal.SIGTERM)
    try:
        code, stderr = _finish(launcher, timeout=30)
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    waited = time.time() - start
    assert code == 143 and 7 < waited < 20, (code, waited)
    assert "did not stop within 8 s was killed" in stderr.strip().splitlines()[-1], stderr
    assert [p for p in workers if alive(p)] == []


def test_sigterm_to_one_worker_stops_every_worker_at_one_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, stderr, workers = _signal_a_worker(run, signal.SIGTERM)
    assert code == 143, stderr
    line = stderr.strip().splitlines()[-1]
    state = checkpoint.load(run)
    assert f"stopped by SIGTERM at step {state['step']}" in line and f"--resume {run}" in line, stderr
    _none_left(workers)


def _nan_on_rank_1(logits, y):  # noqa: ANN001, ANN202
    """Cross-entropy, but NaN on rank 1 from its 4th training step on."""
    import torch
    import torch.distributed as dist

    _nan_on_rank_1.calls = getattr(_nan_on_rank_1, "calls", 0) + 1
    value = torch.nn.functional.cross_entropy(logits, y)
    # (paratrain tries the loss once in the launching process, outside any group, before the workers start)
    return value * float("nan") if dist.is_initialized() and dist.get_rank() == 1 and _nan_on_rank_1.calls == 4 \
        else value


def test_a_nan_on_one_worker_stops_both_before_that_update(tmp_path: Path) -> None:
    import paratrain

    run = tmp_path / "run"
    with pytest.raises(paratrain.UserError, match="the loss became nan at step 4") as e:  # raised in the caller
        paratrain.fit(None, "digits", paratrain.TrainConfig(devices="2", steps=20, checkpoint_every=1, out=str(run),
                                                            quiet=True, tensorboard=False), loss=_nan_on_rank_1)
    assert e.value.code == 3
    assert checkpoint.load(run)["step"] == 3  # both stopped before the update of step 4


def test_torchrun_max_restarts_carries_on_after_a_killed_worker(tmp_path: Path) -> None:
    """torchrun itself, 2 workers, --max-restarts 1: kill -9 one worker after a checkpoint; torchrun starts
    both again, they carry on from the checkpoint, and the run ends with the weights of one nobody touched."""
    args = ("--quiet", "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.05", "--steps", "400",
            "--checkpoint-every", "5", "--log-every", "1")
    run = tmp_path / "run"
    # As docs/how-to/torchrun.md says for restarts: with the shared rendezvous store a restarted worker once read
    # the address its peer had before the restart (gloo: connection refused; seen in CI, 1 run of 3).
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "--max-restarts", "1", "-m", "paratrain", "train", "--out", str(run), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    wait_for(lambda: any(r.get("step", 0) >= 12 for r in _records(run)), 120, "step 12")

    def workers() -> list[int]:
        found = []
        for pid in descendants(agent.pid):
            try:
                if b"paratrain" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
        return found

    first = workers()
    assert len(first) == 2, first
    os.kill(first[1], signal.SIGKILL)
    code, stderr = _finish(agent, timeout=300)
    assert code == 0, stderr[-3000:]
    assert "carrying on from the checkpoint of step" in stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == 400 and summary["resumed_from_step"] >= 10
    train_here(tmp_path / "whole", *args[2:], "--devices", "2")
    assert max_abs_diff(weights(run), weights(tmp_path / "whole")) < 1e-6


# ---- a crash, a bug in your code during training, and a power loss ----

def test_a_worker_that_crashes_ends_the_run_with_exit_1(tmp_path: Path) -> None:
    """A segmentation fault in one worker (a crash, not an exception): the group is stopped, exit 1."""
    model = crashing_model(tmp_path, "if dist.get_rank() == 1: os.kill(os.getpid(), signal.SIGSEGV)")
    launcher = _launch(tmp_path / "run", "--model", model, "--devices", "2", "--steps", "50")
    code, stderr = _finish(launcher, timeout=120)
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and "worker 1 died" in last and "SIGSEGV" in last, stderr
    assert "--max-restarts 1 (or more) restarts the run" in last


def test_a_bug_in_your_code_during_training_shows_its_traceback_and_exits_1(tmp_path: Path) -> None:
    """A network that raises only in training (after the check before launch passed): the worker's traceback,
    then one line naming your line, and no restart suggested, even with --max-restarts (it would fail again)."""
    model = crashing_model(tmp_path, "raise ValueError('a bug of mine at step 4')")
    launcher = _launch(tmp_path / "run", "--model", model, "--devices", "2", "--steps", "50", "--max-restarts", "1")
    code, stderr = _finish(launcher, timeout=120)
    last = stderr.strip().splitlines()[-1]
    assert code == 1, stderr
    assert "Traceback" in stderr and 'net.py", line 20, in forward' in stderr  # the worker's own traceback
    assert "ValueError: a bug of mine at step 4 (at net.py:20 in forward" in last, last
    assert "the error is in your code" in last and "restarting" not in stderr


def test_a_power_loss_loses_only_the_steps_since_the_last_checkpoint(tmp_path: Path) -> None:
    """Every process of the run killed at once (kill -9, as a power loss would): --resume carries on from the
    last complete checkpoint and ends with the weights of a run nobody touched."""
    run = tmp_path / "run"
    args = ("--devices", "2", "--steps", "60", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
            "--checkpoint-every", "5", "--log-every", "1")
    launcher = _launch(run, *args)
    wait_for(lambda: any(r.get("step", 0) >= 23 for r in _records(run)), 120, "step 23")
    everyone = [launcher.pid, *descendants(launcher.pid)]
    for pid in everyone:
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    _none_left(everyone)
    saved = checkpoint.load(run)["step"]
    assert 20 <= saved < 60 and saved % 5 == 0
    resumed = subprocess.run([sys.executable, "-m", "paratrain", "train", "--quiet", "--resume", str(run)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == saved
    train_here(tmp_path / "whole", "--no-tensorboard", *args)
    assert max_abs_diff(weights(run), weights(tmp_path / "whole")) < 1e-6
