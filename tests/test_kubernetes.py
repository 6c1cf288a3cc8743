"""The Kubernetes manifests' container command, run as the Kubeflow training operator runs it, without
Kubernetes: two "pods", each a network namespace with the pod's host name (a UTS namespace) and a hosts file
naming the pods (a mount namespace, as a cluster's DNS would), each running the PyTorchJob's `command` with the
environment the operator sets for its elasticPolicy (PET_RDZV_ENDPOINT at worker-0, PET_RDZV_BACKEND, PET_NNODES,
PET_MAX_RESTARTS, PET_NPROC_PER_NODE, which torchrun reads as its defaults), the manifest's own env, and the run
folder on a shared "persistent volume". They form the group; after a pod is killed (kill -9 of everything in
it) and started again, as restartPolicy OnFailure does, the run carries on and ends with the weights of a job
that was never killed. Skipped where the namespaces cannot be made (not root) or MNIST is not in ../shared."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import adam_moments, descendants, logged_step, max_abs_diff, newest_state, veth_namespaces

pytestmark = pytest.mark.integration

MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "kubernetes" / "pytorchjob.yaml"
# appended to the manifest's command (argparse: the last wins): a short run with checkpoints to carry on from,
# 1 thread a pod (both "nodes" share this machine's cores)
SHORT = ("--steps", "200", "--batch-size", "64", "--checkpoint-every", "50", "--log-every", "1",
         "--threads-per-worker", "1", "--quiet", "--no-tensorboard")


@pytest.fixture(scope="module")
def pods() -> list[str]:
    """The two pods' network namespaces (10.79.0.1 is worker-0, 10.79.0.2 worker-1)."""
    try:
        with veth_namespaces("10.79.0") as (names, _links):
            yield names
            return
    except OSError as e:
        reason = str(e)
    pytest.skip(f"the pods need two network namespaces, which cannot be made here ({reason})")


def _operator_env(job: dict) -> list[dict[str, str]]:
    """What the training operator (v1) adds to a Worker's container for an elasticPolicy: its envvar.go and
    elastic.go, for a job with Worker replicas only."""
    policy = job["spec"]["elasticPolicy"]
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    return [{"name": "PYTHONUNBUFFERED", "value": "0"},
            {"name": "PET_RDZV_ENDPOINT", "value": f"{job['metadata']['name']}-worker-0:{port}"},
            {"name": "PET_RDZV_BACKEND", "value": policy["rdzvBackend"]},
            {"name": "PET_NNODES", "value": f"{policy['minReplicas']}:{policy['maxReplicas']}"},
            {"name": "PET_MAX_RESTARTS", "value": str(policy["maxRestarts"])},
            {"name": "PET_NPROC_PER_NODE", "value": str(policy["nProcPerNode"])}]


def _start_pod(ns: str, index: int, job: dict, volume: Path, folder: Path) -> subprocess.Popen:
    """Pod worker-INDEX: the container's command (its mount path on the shared volume) in namespace `ns`."""
    name = job["metadata"]["name"]
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = spec["containers"][0]
    mount = container["volumeMounts"][0]["mountPath"]
    command = [a.replace(mount, str(volume)) for a in container["command"]] + list(SHORT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM")) and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({e["name"]: e["value"] for e in [*container.get("env", []), *_operator_env(job)]})
    hosts = folder / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n10.79.0.1 {name}-worker-0\n10.79.0.2 {name}-worker-1\n")
    torchrun = str(Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" / "torchrun")
    if not Path(torchrun).exists():
        torchrun = "torchrun"
    script = (f"hostname {name}-worker-{index} && mount --bind {hosts} /etc/hosts && exec "
              + " ".join([torchrun if command[0] == "torchrun" else command[0], *command[1:]]))
    log = open(folder / f"worker-{index}.log", "a")  # noqa: SIM115 (open for the pod's life)
    return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c", script],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(pod: subprocess.Popen) -> None:
    """kill -9 of every process in the pod (torchrun's workers have sessions of their own)."""
    for pid in [pod.pid, *descendants(pod.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _finish(pods: list[subprocess.Popen], folder: Path, timeout: float = 180) -> None:
    try:
        for pod in pods:
            pod.wait(timeout=timeout)
    finally:
        for pod in pods:
            if pod.poll() is None:
                _kill(pod)
    logs = "".join((folder / f"worker-{i}.log").read_text()[-2000:] for i in (0, 1))
    assert [pod.returncode for pod in pods] == [0, 0], logs


def test_the_pytorchjob_command_forms_the_group_and_carries_on_after_a_pod_is_killed(
        pods: list[str], mnist_dir: Path, tmp_path: Path) -> None:
    job = yaml.safe_load(MANIFEST.read_text())
    assert job["kind"] == "PyTorchJob" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    runs = {}
    for case in ("whole", "killed"):
        volume = tmp_path / case / "volume"  # the persistent volume every pod mounts
        (volume / "data").mkdir(parents=True)
        (volume / "data" / "mnist").symlink_to(mnist_dir)
        folder = tmp_path / case
        started = [_start_pod(ns, i, job, volume, folder) for i, ns in enumerate(pods)]
        run = volume / "mnist-k8s"
        if case == "killed":
            deadline = time.monotonic() + 240
            while logged_step(run) < 100:
                assert time.monotonic() < deadline and all(p.poll() is None for p in started), \
                    (folder / "worker-0.log").read_text()[-3000:]
                time.sleep(0.01)
            _kill(started[1])  # the pod is gone, every process in it
            started[1].wait()
            started[1] = _start_pod(pods[1], 1, job, volume, folder)  # restartPolicy OnFailure: it comes back
        _finish(started, folder)
        runs[case] = run
    summary = json.loads((runs["killed"] / "summary.json").read_text())
    assert (summary["launcher"], summary["world_size"], summary["steps"]) == ("torchrun", 2, 200)
    assert summary["restarts"] >= 1 and 100 <= summary["resumed_from_step"] < 200, summary
    a, b = (newest_state(r) for r in (runs["killed"], runs["whole"]))
    assert max_abs_diff(a["model"], b["model"]) <= 1e-6
    assert max_abs_diff(adam_moments(a), adam_moments(b)) <= 1e-6
