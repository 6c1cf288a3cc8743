"""paratrain on a real Slurm cluster (slurm-wlm 22.05 and munge, started on this machine by slurm_cluster.py):
jobs submitted with sbatch and `paratrain submit`, their tasks started by srun. A 2-task job equals one device;
a job whose tasks get Slurm's USR1 mid-run (as `--signal=USR1@T` sends it ahead of a time limit, or
`scancel --signal=USR1` on pre-emption) is requeued by Slurm and ends with an uninterrupted job's weights.
Skipped, with the reason, where Slurm cannot be started (not root, packages missing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import logged_step, max_abs_diff, train, weights
from slurm_cluster import Cluster, one_node_cluster

pytestmark = pytest.mark.integration

EQUAL = ("--quiet", "--no-tensorboard", "--steps", "40", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
         "--batch-size", "64")
LONG = ("--quiet", "--no-tensorboard", "--steps", "300", "--optimizer", "adam", "--lr", "0.001", "--ema", "0.99",
        "--batch-size", "64", "--checkpoint-every", "10", "--log-every", "1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    try:
        with one_node_cluster(tmp_path_factory.mktemp("slurm")) as running:
            yield running
            return
    except OSError as e:
        reason = str(e)
    pytest.skip(f"a Slurm cluster cannot be started here ({reason})")


def _job_script(out: Path, *args: str, tasks: int = 2) -> str:
    return (f"#!/bin/bash\n#SBATCH --ntasks={tasks}\n#SBATCH --output={out.parent / (out.name + '-%j.out')}\n"
            f"srun {sys.executable} -m paratrain train {' '.join(args)} --out {out}\n")


def _output(out: Path, job: str) -> str:
    return (out.parent / f"{out.name}-{job}.out").read_text()


def test_a_two_task_job_equals_one_device(cluster: Cluster, tmp_path: Path) -> None:
    run = tmp_path / "slurm"
    job = cluster.sbatch(_job_script(run, *EQUAL))
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["JobState"] == "COMPLETED", _output(run, job)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["launcher"], summary["world_size"], summary["slurm_job"], summary["requeues"]) == \
        ("slurm", 2, job, 0)
    assert _output(run, job).count("test_accuracy") == 1  # rank 0 reports
    train(tmp_path / "one", *EQUAL, "--devices", "1")
    assert max_abs_diff(weights(run), weights(tmp_path / "one")) < 1e-4


def test_a_preempted_job_is_requeued_and_ends_with_the_uninterrupted_weights(cluster: Cluster,
                                                                            tmp_path: Path) -> None:
    """`paratrain submit` writes and submits the job; USR1 to its tasks mid-run (scancel --signal=USR1, what
    --signal=USR1@T sends before a time limit); every task checkpoints, rank 0 runs scontrol requeue, Slurm
    starts the job again (made eligible at once: it waits 120 s otherwise) and the same script carries on."""
    whole = tmp_path / "whole"
    job = cluster.sbatch(_job_script(whole, *LONG))
    assert cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED", \
        _output(whole, job)[-3000:]

    run = tmp_path / "requeued"
    submitted = subprocess.run([sys.executable, "-m", "paratrain", "submit", "--ntasks-per-node", "2",
                                "--cpus-per-task", "1", "--job-name", "requeue-test", "train", *LONG,
                                "--out", str(run)],
                               env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    assert f"its run folder {run}" in submitted.stdout
    deadline = time.monotonic() + 180
    while logged_step(run) < 25:
        assert time.monotonic() < deadline, f"the job did not get going: {cluster.job(job)}"
        time.sleep(0.01)
    cluster.command("scancel", "--signal=USR1", job)
    info = cluster.wait(job, {"PENDING", "COMPLETED", "FAILED"}, timeout=120)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, log[-3000:])
    assert f"job {job} requeued (requeue 1 of at most 3)" in log, log[-3000:]
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 25 <= saved < 300
    cluster.command("scontrol", "update", f"jobid={job}", "StartTime=now")
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert f"carrying on from the checkpoint of step {saved}" in log, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["launcher"], summary["requeues"], summary["resumed_from_step"], summary["steps"]) == \
        ("slurm", 1, saved, 300)
    a, b = (torch.load(d / "checkpoints" / "last.pt", weights_only=True) for d in (run, whole))
    assert max_abs_diff(a["model"], b["model"]) <= 1e-6
    assert max_abs_diff(a["ema_model"], b["ema_model"]) <= 1e-6
    moments = [{f"{k}.{m}": v[m] for k, v in s["optimizer"]["state"].items() for m in ("exp_avg", "exp_avg_sq")}
               for s in (a, b)]
    assert max_abs_diff(*moments) <= 1e-6
