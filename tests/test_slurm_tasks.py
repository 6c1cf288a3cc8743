"""Two tasks started as srun starts them (Slurm's variables only, no torchrun, no Slurm): they form one
2-worker group (`launcher` slurm) equal to one device; Slurm's warning signal (SIGUSR1) to both checkpoints at
one step, rank 0 calls `scontrol requeue JOB` once (a stand-in scontrol on PATH records it), and the same
command with SLURM_RESTART_COUNT=1 ends with an uninterrupted run's weights, Adam's moments and the EMA.
tests/test_slurm_cluster.py runs the same on a real Slurm cluster. A one-task job of 2 workers (its launcher,
its forkserver, its workers) is requeued the same way."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    adam_moments,
    descendants,
    logged_step,
    max_abs_diff,
    newest_state,
    train_here,
    training_workers,
    weights,
)

from paratrain.runtime.env import PORT_BASE, PORT_SPAN

pytestmark = pytest.mark.integration

# 1 thread a task, as srun's two tasks share this machine's cores. Settings far from divergence.
EQUAL = ("--quiet", "--no-tensorboard", "--steps", "40", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
         "--batch-size", "64")
# long enough that a signal lands mid-run; Adam and the EMA keep state that a requeue must carry over exactly
LONG = ("--quiet", "--no-tensorboard", "--steps", "600", "--optimizer", "adam", "--lr", "0.001", "--ema", "0.99",
        "--batch-size", "64", "--checkpoint-every", "10", "--log-every", "1")


def _job_with_free_port() -> str:
    """A job id whose rendezvous port (env.job_port) is free here now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    if not PORT_BASE <= port < PORT_BASE + PORT_SPAN:  # the kernel's ephemeral range is above it: try ports in it
        for port in range(PORT_BASE + os.getpid() % 1000, PORT_BASE + PORT_SPAN):
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                    break
                except OSError:
                    continue
    return str(port - PORT_BASE + PORT_SPAN)  # beyond PORT_SPAN: the modulo is tested too


def _scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in scontrol that records its arguments and then does what Slurm does on a requeue: SIGTERM to
    every task of the step (the pids in `tasks.pids`), at once and again for 3 s, as the real one's came in
    whatever moment it came (a CI run lost rank 0's line to one that came as its stop handler was taken down)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    pids = tmp_path / "tasks.pids"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                      f'[ "$1" = requeue ] && [ -f {pids} ] && (for i in $(seq 150); do for p in $(cat {pids}); do '
                      f'kill -TERM "$p" 2>/dev/null; done; sleep 0.02; done) >/dev/null 2>&1 &\nexit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir, calls


def _srun(out: Path, args: tuple[str, ...], job: str, bin_dir: Path | None = None,
          restarts: int = 0, ntasks: int = 2) -> list[subprocess.Popen]:
    """`srun -n NTASKS paratrain train ARGS --out OUT` on this one node, as srun sets its tasks' environment."""
    host = socket.gethostname()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                       "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    if bin_dir is not None:
        base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"
    tasks, n = [], str(ntasks)
    for rank in range(ntasks):
        env = {**base, "SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_JOB_NODELIST": host, "SLURM_NODELIST": host,
               "SLURMD_NODENAME": host, "SLURM_NTASKS": n, "SLURM_NPROCS": n, "SLURM_TASKS_PER_NODE": n,
               "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": host, "SLURM_STEP_NUM_TASKS": n,
               "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": n, "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "PYTHONUNBUFFERED": "1"}
        if restarts:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        tasks.append(subprocess.Popen([sys.executable, "-m", "paratrain", "train", *args, "--out", str(out)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return tasks


def _wait(tasks: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    ended = []
    try:
        for task in tasks:
            stdout, stderr = task.communicate(timeout=timeout)
            ended.append((task.returncode, stdout, stderr))
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    return ended


def test_two_srun_tasks_form_one_group_equal_to_one_device(tmp_path: Path) -> None:
    ended = _wait(_srun(tmp_path / "slurm", EQUAL, _job_with_free_port()))
    assert [code for code, _, _ in ended] == [0, 0], ended[0][2][-3000:] + ended[1][2][-3000:]
    assert ended[0][1].count("test_accuracy") == 1 and "test_accuracy" not in ended[1][1]  # rank 0 reports
    summary = json.loads((tmp_path / "slurm" / "summary.json").read_text())
    assert (summary["launcher"], summary["world_size"], summary["steps"]) == ("slurm", 2, 40)
    assert summary["requeues"] == 0 and summary["slurm_job"]
    one = train_here(tmp_path / "one", *EQUAL, "--devices", "1")
    assert one["launcher"] == "spawn" and one["requeues"] is None
    assert max_abs_diff(weights(tmp_path / "slurm"), weights(tmp_path / "one")) < 1e-4


def test_the_warning_signal_checkpoints_requeues_once_and_the_next_start_carries_on(tmp_path: Path) -> None:
    job = _job_with_free_port()
    whole = _wait(_srun(tmp_path / "whole", LONG, job))
    assert [code for code, _, _ in whole] == [0, 0], whole[0][2][-3000:]

    bin_dir, calls = _scontrol(tmp_path)
    run = tmp_path / "requeued"
    tasks = _srun(run, LONG, job, bin_dir)
    (tmp_path / "tasks.pids").write_text(" ".join(str(t.pid) for t in tasks))
    deadline = time.monotonic() + 180
    while logged_step(run) < 25:
        assert time.monotonic() < deadline and all(t.poll() is None for t in tasks), "the run did not get going"
        time.sleep(0.005)
    for task in tasks:  # what Slurm does at --signal=USR1@T: every task of the step gets it
        task.send_signal(signal.SIGUSR1)
    first = _wait(tasks, timeout=60)
    (tmp_path / "tasks.pids").unlink()  # the next start of the job is not requeued
    assert [code for code, _, _ in first] == [128 + signal.SIGUSR1] * 2, first[0][2][-3000:]
    assert calls.read_text() == f"requeue {job}\n"  # once, by rank 0
    assert f"job {job} requeued (requeue 1 of at most 3)" in first[0][2], first[0][2][-2000:]
    saved = newest_state(run)["step"]
    assert 25 <= saved < 600

    again = _wait(_srun(run, LONG, job, bin_dir, restarts=1))  # Slurm starts the job again: the same command
    assert [code for code, _, _ in again] == [0, 0], again[0][2][-3000:]
    assert f"carrying on from the checkpoint of step {saved}" in again[0][2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == saved and summary["steps"] == 600 and summary["requeues"] == 1
    a, b = (newest_state(d) for d in (run, tmp_path / "whole"))
    assert max_abs_diff(a["model"], b["model"]) <= 1e-6
    assert max_abs_diff(a["ema_model"], b["ema_model"]) <= 1e-6
    assert max_abs_diff(adam_moments(a), adam_moments(b)) <= 1e-6
    assert calls.read_text() == f"requeue {job}\n"  # the finished start requeued nothing


def test_a_one_task_job_of_two_workers_is_requeued_by_its_launcher_and_carries_on(tmp_path: Path) -> None:
    """`srun -n 1 paratrain train --devices 2`: the task is a launcher with 2 workers of its own. Slurm's warning
    reaches every process of the step, the forkserver too (it died of it, and took the workers before they
    saved); rank 0 requeues the job, and Slurm's SIGTERM to the launcher and its workers follows. The launcher
    says rank 0's line, that the job was requeued, and the next start says it carries on from the checkpoint."""
    job = _job_with_free_port()
    bin_dir, calls = _scontrol(tmp_path)
    run, args = tmp_path / "requeued", (*LONG, "--devices", "2", "--threads-per-worker", "1")
    [launcher] = _srun(run, args, job, bin_dir, ntasks=1)
    deadline = time.monotonic() + 180
    while logged_step(run) < 1:
        assert time.monotonic() < deadline and launcher.poll() is None, "the run did not get going"
        time.sleep(0.005)
    step = [launcher.pid, *training_workers(launcher.pid)]
    assert len(step) == 3, step
    (tmp_path / "tasks.pids").write_text(" ".join(map(str, step)))  # what the stand-in scontrol sends SIGTERM
    while logged_step(run) < 25:
        assert time.monotonic() < deadline and launcher.poll() is None, "the run stopped early"
        time.sleep(0.005)
    for pid in [launcher.pid, *descendants(launcher.pid)]:  # Slurm's --signal=USR1@T reaches every process of
        os.kill(pid, signal.SIGUSR1)  # the step: the forkserver and multiprocessing's resource tracker too
    [(code, _, stderr)] = _wait([launcher], timeout=60)
    (tmp_path / "tasks.pids").unlink()
    assert code == 128 + signal.SIGUSR1 and "Traceback" not in stderr, stderr[-3000:]
    assert calls.read_text() == f"requeue {job}\n"  # once, by rank 0
    assert f"job {job} requeued (requeue 1 of at most 3)" in stderr, stderr[-2000:]
    saved = newest_state(run)["step"]
    assert 25 <= saved < 600

    [(code, _, stderr)] = _wait(_srun(run, args, job, bin_dir, restarts=1, ntasks=1))
    assert code == 0, stderr[-3000:]
    assert stderr.count(f"carrying on from the checkpoint of step {saved}") == 1  # in the job's log, once
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"], summary["requeues"]) == (saved, 600, 1)
