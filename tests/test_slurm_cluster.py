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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import adam_moments, logged_step, max_abs_diff, newest_state, train_here, weights
from slurm_cluster import Cluster, one_node_cluster, two_node_cluster

pytestmark = pytest.mark.integration

EQUAL = ("--quiet", "--no-tensorboard", "--steps", "40", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
         "--batch-size", "64")
# 600 steps: the USR1 sent at step 25 travels scancel -> slurmctld -> slurmd -> the step, and must come before the end
LONG = ("--quiet", "--no-tensorboard", "--steps", "600", "--optimizer", "adam", "--lr", "0.001", "--ema", "0.99",
        "--batch-size", "64", "--checkpoint-every", "10", "--log-every", "1")


def _started(make: Callable[[Path], Any], folder: Path, what: str) -> Iterator[Cluster]:
    """A cluster for a module's tests, or a skip saying why it cannot be started here."""
    try:
        with make(folder) as running:
            yield running
            return
    except OSError as e:
        reason = str(e)
    pytest.skip(f"{what} cannot be started here ({reason})")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _started(one_node_cluster, tmp_path_factory.mktemp("slurm"), "a Slurm cluster")


def _job_script(out: Path, *args: str, resources: str = "--ntasks=2") -> str:
    return (f"#!/bin/bash\n#SBATCH {resources}\n#SBATCH --output={out.parent / (out.name + '-%j.out')}\n"
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
    train_here(tmp_path / "one", *EQUAL, "--devices", "1")
    assert max_abs_diff(weights(run), weights(tmp_path / "one")) < 1e-4


def test_a_preempted_job_is_requeued_and_ends_with_the_uninterrupted_weights(cluster: Cluster,
                                                                            tmp_path: Path) -> None:
    """`paratrain submit` writes and submits the job; USR1 to its tasks mid-run (scancel --signal=USR1, what
    --signal=USR1@T sends before a time limit); every task checkpoints, rank 0 runs scontrol requeue, Slurm
    starts the job again (made eligible at once: it waits 120 s otherwise) and the same script carries on, into
    the same MLflow run."""
    mlflow = pytest.importorskip("mlflow", reason="the mlflow package is not installed (the [mlflow] extra)")
    whole = tmp_path / "whole"
    job = cluster.sbatch(_job_script(whole, *LONG))
    assert cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED", \
        _output(whole, job)[-3000:]

    run = tmp_path / "requeued"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the requeued job logs into the MLflow run it began
    submitted = subprocess.run([sys.executable, "-m", "paratrain", "submit", "--ntasks-per-node", "2",
                                "--cpus-per-task", "1", "--job-name", "requeue-test", "train", *LONG,
                                "--logger", "mlflow", "--mlflow-uri", store, "--out", str(run)],
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
    saved = newest_state(run)["step"]
    assert 25 <= saved < 600
    cluster.start_again(job)
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert f"carrying on from the checkpoint of step {saved}" in log, log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["launcher"], summary["requeues"], summary["resumed_from_step"], summary["steps"]) == \
        ("slurm", 1, saved, 600)
    a, b = (newest_state(d) for d in (run, whole))
    assert max_abs_diff(a["model"], b["model"]) <= 1e-6
    assert max_abs_diff(a["ema_model"], b["ema_model"]) <= 1e-6
    assert max_abs_diff(adam_moments(a), adam_moments(b)) <= 1e-6
    client = mlflow.MlflowClient(store)
    [tracked] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.data.tags["launcher"] == "slurm"
    steps = {m.step for m in client.get_metric_history(tracked.info.run_id, "loss")}
    assert min(steps) == 1 and max(steps) == 600 and saved + 1 in steps  # both jobs' steps, in one run


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _started(two_node_cluster, tmp_path_factory.mktemp("slurm2"), "a two-node Slurm cluster")


def _sent(cluster: Cluster) -> list[int]:
    """Bytes each node has sent through its link to the others."""
    return [int(subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
                               capture_output=True, text=True, check=True).stdout)
            for ns, link in zip(cluster.namespaces, cluster.interfaces, strict=True)]


def test_a_job_across_two_nodes_equals_one_device(two_nodes: Cluster, tmp_path: Path) -> None:
    """sbatch -N 2 --ntasks-per-node 1: one task on node1, one on node2 (each a network namespace with its own
    host name), meeting at node1 by name; the gradients cross the nodes' links."""
    run = tmp_path / "slurm"
    before = _sent(two_nodes)
    job = two_nodes.sbatch(_job_script(run, *EQUAL, resources="--nodes=2 --ntasks-per-node=1 --cpus-per-task=1"))
    info = two_nodes.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["JobState"] == "COMPLETED", _output(run, job)[-3000:]
    assert info["NodeList"] == "node[1-2]", info
    sent = [after - b for after, b in zip(_sent(two_nodes), before, strict=True)]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["launcher"], summary["world_size"], summary["slurm_job"]) == ("slurm", 2, job)
    # 40 all-reduces of LeNet-5's 61,706 float32 gradients: each node sends at least half of them each step
    assert min(sent) > 40 * 61_706 * 4 // 2, sent
    train_here(tmp_path / "one", *EQUAL, "--devices", "1")
    assert max_abs_diff(weights(run), weights(tmp_path / "one")) < 1e-4


def test_the_doctor_in_a_two_node_job(two_nodes: Cluster, tmp_path: Path) -> None:
    """`srun paratrain doctor` across the two nodes: the job as Slurm sees it against what paratrain uses, and
    a sweep of all-reduces whose bytes crossed between the nodes; rank 0 speaks."""
    script = ("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1\n"
              f"#SBATCH --output={tmp_path / 'doctor-%j.out'}\n"
              f"srun {sys.executable} -m paratrain doctor --timeout 30 --out {tmp_path / 'report'}\n")
    job = two_nodes.sbatch(script)
    info = two_nodes.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    log = (tmp_path / f"doctor-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    report = json.loads((tmp_path / "report" / "doctor.json").read_text())
    assert report["passed"] and sorted(n["node"] for n in report["nodes"]) == [0, 1], report["nodes"]
    assert sorted(n["host"] for n in report["nodes"]) == ["node1", "node2"]
    assert report["slurm"]["job"] == job and report["slurm"]["nodes"] == ["node1", "node2"]
    slurm = next(c for c in report["checks"] if c["name"] == "slurm")
    assert slurm["status"] == "ok" and slurm["detail"].startswith(
        f"job {job}: 2 node(s) (node1, node2), 2 task(s) (1 on this node), 1 --cpus-per-task; paratrain trains 2 "
        "cpu worker(s) x 1 thread(s), 2 node(s) joined"), slurm
    assert all(r["wrong"] == 0 for r in report["collectives"]["rows"])
    assert "across 2 node(s)" in log and log.count("doctor: every check passed") == 1


SPACE = "fixed: {model: mlp, dataset: synthetic}\nparams:\n  width: [16, 32]\n  lr: [0.001, 0.01]\n"


def test_a_search_as_a_job_array_shares_one_study_and_loses_no_trial_to_a_requeue(cluster: Cluster, postgres: str,
                                                                                 tmp_path: Path) -> None:
    """`paratrain submit --array 2 ... search`: task 0 starts a 4-point grid's study in PostgreSQL, task 1 joins
    it; USR1 to task 1 in the middle of a trial stops its pool, queues that trial again at once and requeues task
    1 alone; Slurm starts it again, and every point of the grid completes exactly once."""
    import optuna

    from paratrain.search.study import storage

    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    submitted = subprocess.run(
        [sys.executable, "-m", "paratrain", "submit", "--array", "2", "--cpus-per-task", "1", "--job-name", "grid",
         "search", "--space", str(space), "--sampler", "grid", "--storage", postgres, "--study", "array",
         "--parallel", "1", "--steps", "1000", "--out", str(tmp_path / "search")],
        env=cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    array = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    tasks = [f"{array}_0", f"{array}_1"]

    def running_on_task_1() -> bool:
        """Task 1 is training a trial (its pool process, by `scontrol listpids`, holds a running trial)."""
        try:  # the tasks make the tables: a probe that made them too would race them (see test_search)
            study = optuna.load_study(study_name="array", storage=storage(postgres, create_tables=False))
        except Exception:  # noqa: BLE001 (task 0 has not made the tables or the study yet)
            return False
        listed = cluster.command("scontrol", "listpids", cluster.job(tasks[1])["JobId"], check=False).split()
        pids = {p for p in listed if p.isdigit()}
        return any(t.state.name == "RUNNING" and str(t.user_attrs.get("worker", "")).split(":")[-1] in pids
                   for t in study.get_trials())

    deadline = time.monotonic() + 180
    while not running_on_task_1():
        assert time.monotonic() < deadline, (cluster.job(tasks[0]), cluster.job(tasks[1]))
        time.sleep(0.2)
    cluster.command("scancel", "--signal=USR1", tasks[1])
    info = cluster.wait(tasks[1], {"PENDING", "COMPLETED", "FAILED"}, timeout=120)
    log = (tmp_path / f"slurm-{array}_1.out").read_text()
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", (info, log[-3000:])
    # task 1 alone: `scontrol requeue ARRAY_1`, never the array's own id, which would requeue task 0 too
    assert f"the trials that were running stopped, to be tried again; job {tasks[1]} requeued" in log, log[-3000:]
    assert cluster.job(tasks[0])["Restarts"] == "0"
    cluster.start_again(tasks[1])
    for task in tasks:
        info = cluster.wait(task, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
        assert info["JobState"] == "COMPLETED", (tmp_path / f"slurm-{task}.out").read_text()[-3000:]
    study = optuna.load_study(study_name="array", storage=postgres)
    done = [t for t in study.get_trials() if t.state.name == "COMPLETE" and not t.user_attrs.get("unused")]
    seen = [(t.number, t.state.name, t.params, t.user_attrs.get("retry_of")) for t in study.get_trials()]
    assert sorted((t.params["width"], t.params["lr"]) for t in done) == sorted(
        (w, lr) for w in (16, 32) for lr in (0.001, 0.01)), seen  # each point once: none lost, none twice
    assert any(t.user_attrs.get("retry_of") is not None for t in done), seen  # the stopped trial, tried again



def test_srun_torchrun_keeps_working(cluster: Cluster, tmp_path: Path) -> None:
    """`srun torchrun ...`, one task that starts torchrun's workers: torchrun's variables win over Slurm's, and
    the run equals one device."""
    run = tmp_path / "torchrun"
    script = (f"#!/bin/bash\n#SBATCH --ntasks=1 --cpus-per-task=2\n#SBATCH --output={tmp_path / 'torchrun-%j.out'}\n"
              f"srun {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 -m paratrain train "
              f"{' '.join(EQUAL)} --threads-per-worker 1 --out {run}\n")
    job = cluster.sbatch(script)
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["JobState"] == "COMPLETED", (tmp_path / f"torchrun-{job}.out").read_text()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["launcher"], summary["world_size"], summary["slurm_job"]) == ("torchrun", 2, job)
    train_here(tmp_path / "one", *EQUAL, "--devices", "1")
    assert max_abs_diff(weights(run), weights(tmp_path / "one")) < 1e-4
