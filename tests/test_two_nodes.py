"""Two machines under torchrun: two agents as two nodes, each with one worker and its own run folder.

As root with `ip netns`, each node lives in a network namespace of its own, joined to the other by a veth
pair (10.77.0.1 and 10.77.0.2, made here and removed after), so every byte between them crosses a real
interface (GLOO_SOCKET_IFNAME); the tests check that the gradients' bytes crossed it. Where the namespaces
cannot be made (not root, no ip(8)) the tests skip and say why; torchrun on one node is tested in test_launch.
Each node has its own --out, as separate machines have separate disks: only rank 0's is written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    alive,
    descendants,
    logged_step,
    max_abs_diff,
    newest_state,
    train,
    train_here,
    veth_namespaces,
    weights,
)

from paratrain.checkpoint import files as checkpoint
from paratrain.runtime.tcp_timeout import give_up_s

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # wall-time bounds: .ci/run runs it alone

# Both "machines" share this one's cores: 1 thread each. SGD with momentum at lr 0.01, far from the chaotic
# lr 0.05 where float noise between worker counts grows to 1e-2 in 40 steps.
TRAIN = ("--quiet", "--no-tensorboard", "--steps", "40", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
         "--batch-size", "64", "--checkpoint-every", "5", "--log-every", "1", "--threads-per-worker", "1")


@dataclass
class Node:
    prefix: list[str]  # what runs a command on this node
    address: str
    interface: str


@pytest.fixture(scope="module")
def nodes() -> list[Node]:
    try:
        with veth_namespaces("10.77.0") as (names, links):
            yield [Node(["ip", "netns", "exec", ns], f"10.77.0.{i + 1}", link)
                   for i, (ns, link) in enumerate(zip(names, links, strict=True))]
            return
    except OSError as e:
        reason = str(e)
    pytest.skip(f"two nodes need two network namespaces joined by a veth pair, which cannot be made here ({reason})")


def _sent(node: Node) -> int:
    """Bytes this node has sent through its end of the veth pair."""
    out = subprocess.run([*node.prefix, "cat", f"/sys/class/net/{node.interface}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(nodes: list[Node], out: Path, *extra: str, restarts: int = 0,
           command: tuple[str, ...] | None = None, rdzv: str = "", shared: bool = False) -> list[subprocess.Popen]:
    """One torchrun agent per node, node 0 hosting the rendezvous; node i writes into out/node{i}, or (`shared`:
    a file system both nodes mount, as sharded checkpoints need) into out. The command is a training of TRAIN
    and `extra`, or `command` (paratrain's arguments)."""
    port = _free_port()  # free here; in the namespaces every port is free
    job = uuid.uuid4().hex[:8]
    agents = []
    for i, node in enumerate(nodes):
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: the workers' store keys are kept apart by a restart count that
        # torchrun keeps per node, so after one node's restart the other's workers read stale addresses and
        # the group hangs (pytorch/pytorch#135712); docs/how-to/torchrun.md gives this line for multi-node restarts.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "PYTHONUNBUFFERED": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        cmd = [*node.prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
               "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[0].address}:{port}", "--rdzv-id", job,
               "--rdzv-conf", f"is_host={int(i == 0)}{rdzv}", "--local-addr", node.address, "--max-restarts",
               str(restarts), "--monitor-interval", "0.5", "-m", "paratrain",
               *(command or ("train", *TRAIN, *extra)), "--out", str(out if shared else out / f"node{i}")]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    return agents


def _finish(agents: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=timeout)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    for agent, log in zip(agents, logs, strict=True):
        assert agent.returncode == 0, log[-3000:]
    return logs


def _rank0_dir(out: Path) -> Path:
    """The node folder that holds the finished run (rank 0's; it may move between nodes on a restart)."""
    done = [d for d in (out / "node0", out / "node1") if (d / "summary.json").is_file()]
    return max(done, key=lambda d: (d / "summary.json").stat().st_mtime)


SENT: dict[str, int] = {}  # bytes each node sent over the veth pair during the two-node run


@pytest.fixture(scope="module")
def two_node_run(nodes: list[Node], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two-nodes")
    before = [_sent(node) for node in nodes]
    _finish(_start(nodes, out))
    SENT.update({f"node{i}": _sent(node) - b for i, (node, b) in enumerate(zip(nodes, before, strict=True))})
    assert sum((out / f"node{i}").exists() for i in (0, 1)) == 1  # only rank 0's node writes the run directory
    return _rank0_dir(out)


def test_two_nodes_equal_one_device(two_node_run: Path, tmp_path: Path) -> None:
    summary = json.loads((two_node_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp" and summary["steps"] == 40
    # 40 all-reduces of LeNet-5's 61,706 float32 gradients: each node sends at least half of them each step
    assert min(SENT.values()) > 40 * 61_706 * 4 // 2, SENT
    train_here(tmp_path / "one", *TRAIN, "--devices", "1")
    assert max_abs_diff(weights(two_node_run), weights(tmp_path / "one")) < 1e-4  # measured 1.1e-6


def test_fsdp_on_two_nodes_equals_one_device_and_carries_on_with_one(nodes: list[Node], tmp_path: Path) -> None:
    """fsdp across the two nodes, its sharded checkpoints in one folder both mount: the weights of one device
    (in fsdp's memory layout); carried on from its step-25 checkpoint by one worker, the same weights again;
    with a folder on each node's own disk, one line and no checkpoint."""
    out = tmp_path / "fsdp"
    _finish(_start(nodes, out, "--strategy", "fsdp", "--keep-checkpoints", "100", shared=True))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["launcher"] == "torchrun"
    assert {p.name for p in (out / "checkpoints" / "step-00000040").glob("*.distcp")} == {"__0_0.distcp",
                                                                                          "__1_0.distcp"}
    one = tmp_path / "one"
    train_here(one, *TRAIN, "--devices", "1", "--memory-format", "contiguous")
    print(f"two-node fsdp vs one device: {max_abs_diff(weights(out), weights(one)):.3g}", file=sys.stderr)
    assert max_abs_diff(weights(out), weights(one)) < 1e-4  # measured 1.1e-6
    carried = tmp_path / "carried"  # as if the job had ended after its step-25 checkpoint
    shutil.copytree(out, carried, ignore=shutil.ignore_patterns("step-0000003*", "step-0000004*", "summary.json"))
    assert train(carried, "--resume", str(carried), "--devices", "1")["resumed_from_step"] == 25
    print(f"carried on by one worker: {max_abs_diff(weights(carried), weights(out)):.3g}", file=sys.stderr)
    assert max_abs_diff(weights(carried), weights(out)) < 3e-6  # measured 3.0e-8
    # each node with a folder of its own (separate disks): rank 1's shards never reach rank 0's folder
    agents = _start(nodes, tmp_path / "apart", "--strategy", "fsdp")
    logs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert all(agent.returncode != 0 for agent in agents), logs[0][-2000:]
    assert "pass an --out on a file system every node mounts" in logs[0], logs[0][-3000:]
    assert not list((tmp_path / "apart" / "node0" / "checkpoints").glob("step-*"))  # none published


def _worker_of(agent: subprocess.Popen) -> int | None:
    for pid in descendants(agent.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"paratrain" in cmdline and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def test_killed_worker_on_one_node_restarts_to_the_same_weights(nodes: list[Node], two_node_run: Path,
                                                                 tmp_path: Path) -> None:
    """kill -9 of a worker mid-run on the node that is not rank 0's, torchrun --max-restarts 1 on both agents:
    the group restarts, finds the newest checkpoint (on rank 0's disk only) and ends with the uninterrupted
    job's weights and momentum."""
    agents = _start(nodes, tmp_path, restarts=1)
    deadline = time.monotonic() + 180
    while max(logged_step(tmp_path / f"node{i}") for i in (0, 1)) < 12:
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the job did not get going"
        time.sleep(0.005)
    other = 1 if (tmp_path / "node0" / "metrics.jsonl").exists() else 0  # the node that is not rank 0's
    assert not (tmp_path / f"node{other}" / "checkpoints").exists()  # it has no checkpoint of its own
    victim = _worker_of(agents[other])
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    logs = _finish(agents)
    run = _rank0_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == 40, "".join(logs)[-3000:]
    resumed = summary["resumed_from_step"]  # the last checkpoint before the kill, at step 12 or later
    assert resumed % 5 == 0 and 10 <= resumed < 40
    state, whole = (newest_state(d) for d in (run, two_node_run))
    assert max_abs_diff(state["model"], whole["model"]) <= 1e-6
    momentum = [{k: v for k, v in s["optimizer"].items() if k.endswith(".momentum_buffer")} for s in (state, whole)]
    assert momentum[0]
    assert max_abs_diff(*momentum) <= 1e-6


def test_the_doctor_on_two_nodes_reports_each_and_the_link_between_them(nodes: list[Node], tmp_path: Path) -> None:
    """`paratrain doctor` under torchrun: rank 0 reports both nodes' inventories and an all-reduce sweep whose
    bytes crossed the veth pair, and warns of the node whose TCP keeps torchrun's agent waiting after a
    partition beyond --collective-timeout's default (Linux's default tcp_retries2 on node 0, 5 on node 1)."""
    before = [_sent(node) for node in nodes]
    with _tcp_retries(nodes[1], 5):
        logs = _finish(_start(nodes, tmp_path, command=("doctor", "--timeout", "30")))
    sent = [_sent(node) - b for node, b in zip(nodes, before, strict=True)]
    written = [d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "doctor.json").is_file()]
    assert len(written) == 1  # rank 0 speaks for the group
    report = json.loads((written[0] / "doctor.json").read_text())
    assert report["passed"] and sorted(n["node"] for n in report["nodes"]) == [0, 1]
    rows = report["collectives"]["rows"]
    assert all(r["wrong"] == 0 for r in rows) and rows[-1]["bytes"] >= 2**20
    assert min(sent) > rows[-1]["bytes"] // 2, sent  # the sweep's largest message crossed between the nodes
    assert "across 2 node(s)" in "".join(logs) and "doctor: every check passed, 1 with a warning" in "".join(logs)
    retries = {n["tcp_retries2"]: n["node"] for n in report["nodes"]}  # node ranks follow the rendezvous
    assert sorted(retries) == [5, 15], report["nodes"]
    partition = next(c for c in report["checks"] if c["name"] == "partition")
    assert partition["status"] == "slow", partition
    assert f"tcp_retries2 = 15 on node {retries[15]} (at least 925 s)" in partition["detail"], partition
    assert f"node {retries[5]}" not in partition["detail"], partition


def _link(node: Node, state: str) -> None:
    """Take this node's end of the veth pair down or up: a network partition between the two nodes, or its end."""
    subprocess.run([*node.prefix, "ip", "link", "set", "dev", node.interface, state], check=True, capture_output=True)


def _everything(agents: list[subprocess.Popen]) -> list[int]:
    return [p for a in agents for p in (a.pid, *descendants(a.pid))]


@contextmanager
def _tcp_retries(node: Node, retries: int) -> Iterator[None]:
    """net.ipv4.tcp_retries2 in this node's network namespace (each has its own), set back after."""
    path = "/proc/sys/net/ipv4/tcp_retries2"
    before = subprocess.run([*node.prefix, "cat", path], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([*node.prefix, "sh", "-c", f"echo {retries} > {path}"], check=True)
    try:
        yield
    finally:
        subprocess.run([*node.prefix, "sh", "-c", f"echo {before} > {path}"], check=True)


def test_a_network_partition_ends_every_process_within_the_collective_timeout(nodes: list[Node],
                                                                             tmp_path: Path) -> None:
    """The link between the nodes goes down mid-run and stays down: each worker's collective gives up after
    --collective-timeout (10 s) and says so in one line, and every process of the job has ended soon after:
    the workers, the agent of the node that hosts the rendezvous, and, with net.ipv4.tcp_retries2 = 5 there as
    the workers' line advises for a 10 s timeout, torchrun's agent on the node that was cut off
    (it waits for TCP to give up on the rendezvous store: at least 925 s at Linux's default of 15). The
    worker's line on node 0, at that default, says what would happen were it cut off and what to set; the last
    checkpoint loads."""
    timeout = 10
    with _tcp_retries(nodes[1], 5):
        agents = _start(nodes, tmp_path, "--steps", "100000", "--collective-timeout", str(timeout))
        try:
            deadline = time.monotonic() + 180
            while max(logged_step(tmp_path / f"node{i}") for i in (0, 1)) < 12:
                assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the job did not go"
                time.sleep(0.01)
            assert None not in [_worker_of(agent) for agent in agents]
            processes = _everything(agents)
            _link(nodes[1], "down")
            cut = time.monotonic()
            while any(alive(p) for p in processes) and time.monotonic() - cut < 60:
                time.sleep(0.1)
            ended = time.monotonic() - cut
            left = [p for p in processes if alive(p)]
        finally:
            _link(nodes[1], "up")
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
    logs = [agent.communicate()[0] for agent in agents]
    assert not left, f"processes left {ended:.0f} s after the cut: {''.join(logs)[-3000:]}"
    bound = max(timeout, give_up_s(5)) + 10  # the cut-off agent's TCP gives up after 12.6 s; then its teardown
    assert ended < bound, f"the job took {ended:.0f} s to end after the cut: {''.join(logs)[-3000:]}"
    assert agents[0].returncode != 0 and agents[1].returncode != 0
    said = [[line for line in log.splitlines() if "--collective-timeout" in line] for log in logs]
    assert [len(lines) for lines in said] == [1, 1], logs
    assert all(f"waited more than --collective-timeout {timeout} s for a worker that stopped answering or a node the "
               "network cut off" in lines[0] for lines in said), said
    assert "this node's net.ipv4.tcp_retries2 is 15: if it is cut off from the rendezvous host, torchrun's agent " \
           "here waits at least 925 s for TCP to give up; `sysctl -w net.ipv4.tcp_retries2=5` on each node makes " \
           "that at least 13 s" in said[0][0], said
    assert "tcp_retries2" not in said[1][0], said  # node 1 has the advised value
    run = next(d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "checkpoints").is_dir())
    assert checkpoint.load(run)["step"] >= 10


def test_after_a_partition_torchrun_restarts_the_group_to_the_weights_of_the_uncut_run(
        nodes: list[Node], two_node_run: Path, tmp_path: Path) -> None:
    """The link goes down for longer than --collective-timeout, then up again: with torchrun's --max-restarts
    the workers that gave up are started again, find the newest checkpoint and end with the weights and
    momentum of the run that was never cut."""
    timeout = 8
    agents = _start(nodes, tmp_path, "--collective-timeout", str(timeout), restarts=2)
    try:
        deadline = time.monotonic() + 180
        while max(logged_step(tmp_path / f"node{i}") for i in (0, 1)) < 12:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the job did not get going"
            time.sleep(0.005)
        _link(nodes[1], "down")
        time.sleep(timeout + 4)
    finally:
        _link(nodes[1], "up")
    logs = _finish(agents)
    run = _rank0_dir(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] >= 1 and summary["steps"] == 40, "".join(logs)[-3000:]
    state, whole = (newest_state(d) for d in (run, two_node_run))
    assert max_abs_diff(state["model"], whole["model"]) <= 1e-6
    momentum = [{k: v for k, v in s["optimizer"].items() if k.endswith(".momentum_buffer")} for s in (state, whole)]
    assert momentum[0]
    assert max_abs_diff(*momentum) <= 1e-6
