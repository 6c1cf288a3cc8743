"""Launching: torchrun joins instead of spawning; Ctrl-C leaves no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive, descendants, max_abs_diff, train_here, weights

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # wall-time bounds: .ci/run runs it alone

ARGS = ("--steps", "20", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64")


def test_torchrun_group_equals_single_device(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "torchrun"), *ARGS],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("test_accuracy") == 1  # only rank 0 reports
    one = train_here(tmp_path / "one", *ARGS, "--devices", "1")
    import json

    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert summary["test_accuracy"] == one["test_accuracy"]
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "torchrun")) < 3e-6  # measured 3.0e-8
    # the same command with fewer steps: torchrun's carry-on finds 20 done and refuses, the record kept
    record = (tmp_path / "torchrun" / "summary.json").read_bytes()
    fewer = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "paratrain", "train", "--quiet", "--out", str(tmp_path / "torchrun"), *ARGS, "--steps", "10"],
        capture_output=True, text=True, timeout=300)
    assert fewer.returncode != 0
    assert f"paratrain: error: the run in {tmp_path / 'torchrun'} has done 20 steps, more than the 10 asked for" \
        in fewer.stderr, fewer.stderr[-3000:]
    assert (tmp_path / "torchrun" / "summary.json").read_bytes() == record


def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    # started with SIGINT ignored, as a script's background job is (`cmd &`): Python then keeps it ignored, so
    # the launcher stops on its own handler, the one an interactive start uses too
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "--devices", "2", "--epochs", "1000", "--quiet",
         "--log-every", "1", "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.stat().st_size) and time.time() < deadline:
        time.sleep(0.2)
    assert metrics.exists(), "training never started"
    workers = descendants(launcher.pid)
    assert len(workers) >= 2
    start = time.time()
    launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends (here to the launcher alone, the harder case)
    try:
        code = launcher.wait(timeout=20)
    except subprocess.TimeoutExpired:  # seen once in 12 runs, on a loaded machine: say what it was doing
        launcher.send_signal(signal.SIGUSR1)  # the launcher's Python stacks, on its stderr (faulthandler)
        time.sleep(1)
        states = {pid: _state(pid) for pid in [launcher.pid, *workers]}
        for pid in [launcher.pid, *workers]:  # the workers hold the pipe open too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=10)
        pytest.fail(f"the launcher did not exit within 20 s of SIGINT; processes: {states}; its stderr: {err[-6000:]}")
    finally:
        launcher.kill()
    assert code == 130
    while [p for p in workers if alive(p)] and time.time() - start < 10:
        time.sleep(0.2)
    assert [p for p in workers if alive(p)] == [], "workers outlived the launcher by more than 10 s"
    stderr = launcher.stderr.read()
    assert "Traceback" not in stderr, stderr


def _state(pid: int) -> str:
    """A process's state and the kernel function it waits in, for a failure message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "gone"
    shown = ("Name", "State", "SigBlk", "SigIgn", "SigCgt")  # the signals it blocks, ignores, handles
    return " ".join(line for line in status if line.startswith(shown)) + f" wchan {wchan}"
