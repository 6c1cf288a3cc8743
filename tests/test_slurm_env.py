"""Slurm's environment as srun and sbatch set it, read without Slurm: host lists, tasks per node, the group a
step of tasks forms, the checks of a task count against --devices, and the requeue on Slurm's warning signal
(a stand-in scontrol on PATH records what it was asked)."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from paratrain import config as C
from paratrain.core.errors import UserError
from paratrain.parallel import requeue
from paratrain.runtime.devices import for_group, usable_cores
from paratrain.runtime.env import PORT_BASE, PORT_SPAN, detect, expand_hostlist, job_port, tasks_per_node
from paratrain.runtime.interrupt import Stopped, StopRequest

# What a real srun -n 2 set in each task on a one-node cluster (slurm-wlm 22.05), less the paths and ports
# that do not matter here; task 1 differs in SLURM_PROCID and SLURM_LOCALID.
SRUN_TASK = {
    "SLURMD_NODENAME": "vm", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0,1", "SLURM_JOBID": "41",
    "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_LOCALID": "0",
    "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "vm", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": "/tmp", "SLURM_JOB_NAME": "job.sh",
}
# ... and in the batch script's own shell (no step): the job's variables only
BATCH = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP") and k != "SLURM_GTIDS"}


@pytest.mark.parametrize(("hostlist", "hosts"), [
    ("vm", ["vm"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[1,3],b,c[5-6]", ["a1", "a3", "b", "c5", "c6"]),
    ("", []),
])
def test_host_lists_expand_as_scontrol_show_hostnames_does(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(("hostlist", "said"), [("node[1-2", "unbalanced '\\['"), ("node1-2]", "unbalanced '\\]'"),
                                                ("node[a-b]", "is not N or N-M")])
def test_a_host_list_that_does_not_parse_is_one_line(hostlist: str, said: str) -> None:
    with pytest.raises(UserError, match=said):
        expand_hostlist(hostlist)


def test_tasks_per_node_in_full() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(UserError, match="is not N or N\\(xM\\)"):
        tasks_per_node("2(3)")


def test_two_srun_tasks_are_one_group_meeting_at_the_first_host() -> None:
    for procid in (0, 1):
        env = detect({**SRUN_TASK, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid)})
        assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == \
            ("slurm", procid, 2, procid, 2)
        assert env.in_group and env.is_main == (procid == 0) and env.launcher_name == "slurm"
        assert env.init_method == f"tcp://vm:{job_port('41')}" and env.master_port == PORT_BASE + 41
        assert env.slurm is not None and env.slurm.job_id == "41" and env.slurm.restart_count == 0


def test_a_task_on_the_second_of_two_nodes() -> None:
    env = detect({**SRUN_TASK, "SLURMD_NODENAME": "gpu-b3", "SLURM_JOB_NODELIST": "gpu-a1,gpu-b3",
                  "SLURM_STEP_NODELIST": "gpu-a1,gpu-b3", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NODEID": "1",
                  "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 6, 1, 2)
    assert env.master_addr == "gpu-a1" and env.slurm.nodes == ("gpu-a1", "gpu-b3")


def test_master_port_and_requeues_and_array_tasks() -> None:
    env = detect({**SRUN_TASK, "MASTER_PORT": "29400", "SLURM_RESTART_COUNT": "2", "SLURM_ARRAY_TASK_ID": "3",
                  "SLURM_ARRAY_JOB_ID": "38"})
    assert env.master_port == 29400 and env.slurm.restart_count == 2 and env.slurm.array_task == 3
    # a task of an array by its array's id and index: `scontrol requeue 41` names it alone only by luck (one task
    # of an array has the array's own id, and requeueing that id requeues them all)
    assert env.slurm.name == "38_3" and detect(SRUN_TASK).slurm.name == "41"
    assert all(PORT_BASE <= job_port(j) < PORT_BASE + PORT_SPAN for j in ("1", "123456789", "77_3", ""))


def test_the_batch_script_and_a_one_task_step_start_locally_inside_the_job() -> None:
    """`paratrain train` in the batch script itself, or `srun -n 1`: paratrain lays its workers out itself,
    and still knows the job (a requeued job carries its run on)."""
    for environ in (BATCH, {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}):
        env = detect({**environ, "SLURM_RESTART_COUNT": "1"})
        assert env.launcher == "local" and env.launcher_name == "spawn" and not env.in_group
        assert env.slurm is not None and env.slurm.restart_count == 1


def test_torchrun_under_srun_is_torchrun() -> None:
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "gpu-a1", "MASTER_PORT": "29500"}
    env = detect({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2", **torchrun})
    assert (env.launcher, env.rank, env.world_size, env.init_method) == ("torchrun", 3, 4, "env://")
    assert env.slurm is not None and env.slurm.job_id == "41"


def test_no_slurm_no_job() -> None:
    env = detect({})
    assert env.launcher == "local" and env.slurm is None and env.init_method == "env://"


def test_a_task_count_against_devices_is_one_line() -> None:
    env = detect(SRUN_TASK)
    assert for_group(env, "cpu", None, "2").workers == 2
    assert for_group(env, "cpu", None, "auto").threads_per_worker == max(1, usable_cores() // 2)
    with pytest.raises(UserError, match="srun started 2 workers but --devices is 4: under srun every task is "
                                        "one worker; leave out --devices or start 4 with --ntasks"):
        for_group(env, "cpu", None, "4")


def test_a_task_past_the_nodes_gpus_is_one_line(fake_gpus) -> None:  # noqa: ANN001
    fake_gpus(2)
    env = detect({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "3", "SLURM_PROCID": "2",
                  "SLURM_LOCALID": "2"})
    with pytest.raises(UserError, match="srun started 3 workers on this node but it has 2 GPU\\(s\\); use "
                                        "--ntasks-per-node 2"):
        for_group(env, "gpu", None)


# ---- the requeue ----


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in scontrol first on PATH that appends its arguments to a file (and fails on `requeue 13`)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                      '[ "$2" != 13 ] || { echo "Requeue disabled" >&2; exit 1; }\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    old = signal.getsignal(signal.SIGTERM)  # requeue.ask ignores Slurm's SIGTERM: not in this test process after
    yield calls
    signal.signal(signal.SIGTERM, old)


def _stopped_in(run: Path, signum: int = signal.SIGUSR1) -> tuple[Stopped, C.TrainConfig]:
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000012.pt").write_bytes(b"")
    cfg = C.TrainConfig(out=str(run))
    return Stopped(f"stopped by SIGUSR1 at step 12; the checkpoint is in {run}", signum), cfg


def test_the_requeue_signal_requeues_the_job_once_from_rank_0(scontrol: Path, tmp_path: Path) -> None:
    stopped, cfg = _stopped_in(tmp_path / "run")
    env = detect(SRUN_TASK)
    said = [requeue.requeue(stopped, env, cfg, is_main=rank == 0) for rank in (0, 1)]
    assert scontrol.read_text() == "requeue 41\n"  # once, by rank 0
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # Slurm's SIGTERM that follows: said why first
    assert str(said[0]) == (f"stopped by SIGUSR1 at step 12 (checkpointed in {cfg.out}); job 41 requeued (requeue 1 "
                            "of at most 3): when Slurm starts it again, the same command carries the run on from "
                            "that checkpoint")
    assert said[0].code == said[1].code == 128 + signal.SIGUSR1
    assert str(said[1]) == f"stopped by SIGUSR1 at step 12 (checkpointed in {cfg.out}); rank 0 requeues job 41"


class _Reports:
    """The launcher's results queue, as the workers filled it."""

    def __init__(self, *items: dict) -> None:
        self.items = list(items)

    def empty(self) -> bool:
        return not self.items

    def get(self) -> dict:
        return self.items.pop(0)


def test_the_launcher_says_rank_0s_stop_where_another_worker_stopped_first() -> None:
    """A one-task job's launcher printed rank 1's "rank 0 requeues job 41" where rank 1's report came first (a
    race) instead of rank 0's "job 41 requeued"; of the errors, the first is still the one said."""
    from paratrain.parallel.launch import _report_in

    usr1 = 128 + signal.SIGUSR1
    said = _report_in(_Reports({"error": "stopped; rank 0 requeues job 41", "code": usr1, "stopped": True, "rank": 1},
                               {"error": "stopped; job 41 requeued", "code": usr1, "stopped": True, "rank": 0}))
    assert isinstance(said, Stopped) and str(said) == "stopped; job 41 requeued" and said.code == usr1
    said = _report_in(_Reports({"error": "a NaN loss at step 3", "code": 3, "stopped": False, "rank": 1},
                               {"error": "a NaN loss at step 3 (rank 0)", "code": 3, "stopped": False, "rank": 0}))
    assert not isinstance(said, Stopped) and str(said) == "a NaN loss at step 3" and said.code == 3
    assert _report_in(_Reports({"test_accuracy": 0.9})) is None  # a summary is no report


def test_only_the_requeue_signal_of_a_slurm_job_requeues() -> None:
    cfg = C.TrainConfig()
    assert requeue.signal_for(detect(SRUN_TASK), cfg) == signal.SIGUSR1
    assert requeue.signal_for(detect(BATCH), cfg.replace(requeue_signal="USR2")) == signal.SIGUSR2
    assert requeue.signal_for(detect({}), cfg) is None  # no Slurm job: Ctrl-C and SIGTERM stop, never requeue


def test_past_max_requeues_the_job_is_not_requeued(scontrol: Path, tmp_path: Path) -> None:
    stopped, cfg = _stopped_in(tmp_path / "run")
    said = requeue.requeue(stopped, detect({**SRUN_TASK, "SLURM_RESTART_COUNT": "3"}), cfg, True)
    assert not scontrol.exists()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # not requeued: the time limit's SIGTERM ends it
    assert "job 41 was requeued 3 time(s) already (--max-requeues 3), so it is not requeued again; run the same " \
           f"command with --resume {cfg.out} (in a new job too: a job's run folder is named by its id)" in str(said)


def test_no_scontrol_and_a_refused_requeue_are_one_line(scontrol: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    stopped, cfg = _stopped_in(tmp_path / "run")
    said = requeue.requeue(stopped, detect({**SRUN_TASK, "SLURM_JOB_ID": "13"}), cfg, True)
    assert "scontrol requeue 13 failed (Requeue disabled; the cluster may not allow requeueing" in str(said)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    said = requeue.requeue(stopped, detect(SRUN_TASK), cfg, True)
    assert "scontrol is not on PATH here (a container without Slurm's commands?), so job 41 was not requeued: add " \
           "Slurm's client commands" in str(said)
    assert "\n" not in str(said)


def test_a_task_given_cores_uses_them_all() -> None:
    env = detect({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "1"})
    assert env.cpus_per_task == 1 and for_group(env, "cpu", None).threads_per_worker == 1
    many = detect({**SRUN_TASK, "SLURM_CPUS_PER_TASK": "512"})  # never more threads than the cores it may use
    assert for_group(many, "cpu", None).threads_per_worker == usable_cores()
    assert for_group(env, "cpu", 2).threads_per_worker == 2  # --threads-per-worker still wins


def test_the_default_run_folder_in_a_slurm_job_is_the_same_in_every_task_and_start() -> None:
    env = detect({**SRUN_TASK, "SLURM_RESTART_COUNT": "1"})
    assert C.with_run_dir(C.TrainConfig(), env).out == str(Path("runs") / "lenet5-digits-job41")
    assert C.with_run_dir(C.TrainConfig(), detect(BATCH)).out == str(Path("runs") / "lenet5-digits-job41")
    later = detect({**SRUN_TASK, "SLURM_STEP_ID": "2"})  # a second srun in the job's script: a run of its own
    assert C.with_run_dir(C.TrainConfig(), later).out == str(Path("runs") / "lenet5-digits-job41.2")
    assert C.with_run_dir(C.TrainConfig(out="x"), env).out == "x"


def test_a_variable_that_does_not_parse_is_one_line() -> None:
    with pytest.raises(UserError, match="SLURM_PROCID='x' in the environment is not a whole number"):
        detect({**SRUN_TASK, "SLURM_PROCID": "x"})


def test_uneven_tasks_across_nodes_count_the_nodes() -> None:
    env = detect({**SRUN_TASK, "SLURM_STEP_NODELIST": "a,b", "SLURM_STEP_NUM_TASKS": "6",
                  "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURMD_NODENAME": "a"})
    assert (env.nodes, env.local_world_size) == (2, 4)


def test_one_visible_gpu_is_each_srun_tasks_own_but_never_torchruns(fake_gpus) -> None:  # noqa: ANN001
    from paratrain.runtime.devices import group_devices

    fake_gpus(1)
    env = detect({**SRUN_TASK, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert group_devices(env, for_group(env, "gpu", None)) == ("cuda:0", "cuda:0")
    torchrun = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(UserError, match="torchrun started 2 workers on this node but it has 1 GPU"):
        for_group(torchrun, "gpu", None)


def test_the_requeue_signal_stays_once_it_came() -> None:
    stop = StopRequest(signal.SIGUSR1)
    stop(signal.SIGUSR1, None)
    stop(signal.SIGTERM, None)  # what Slurm sends after the requeue, or at the time limit
    assert stop.signum == signal.SIGUSR1
    plain = StopRequest()
    plain(signal.SIGINT, None)
    plain(signal.SIGTERM, None)
    assert plain.signum == signal.SIGTERM


def test_a_requeued_task_leaves_sigterm_ignored_from_the_moment_its_handler_is_taken_down() -> None:
    """Slurm's SIGTERM to a requeued job's tasks came in the moment between the stop handler's removal and a
    later SIG_IGN, and ended rank 0 before it said the job was requeued (a CI run): the SIG_IGN that
    requeue.ask sets while the handler is installed stays when it is taken down."""
    old, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        with StopRequest(signal.SIGUSR1).installed() as stop:
            assert signal.getsignal(signal.SIGTERM) is stop
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what requeue.ask does where the job is requeued
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is old_int  # the handlers still its own are put back
        with StopRequest(signal.SIGUSR1).installed():
            pass
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # what was there before, without the call
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_warning_that_came_while_the_run_started_stops_it_at_once() -> None:
    """In a Slurm job the command holds the warning signals from its start; the run's handler finds one that came
    before it was installed, and the run stops at its first step (and requeues) instead of the task dying."""
    import os

    from paratrain.runtime.interrupt import came_early, hold

    old = signal.getsignal(signal.SIGUSR2)
    try:
        hold((signal.SIGUSR2,))
        os.kill(os.getpid(), signal.SIGUSR2)  # kept, not fatal
        assert came_early(signal.SIGUSR2) and not came_early(signal.SIGUSR1)
        with StopRequest(signal.SIGUSR2).installed() as stop:
            assert stop.signum == signal.SIGUSR2
        with StopRequest().installed() as plain:  # outside a Slurm job nothing was held for it
            assert plain.signum == 0
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_a_negative_requeue_limit_is_one_line(capsys: pytest.CaptureFixture) -> None:
    from conftest import main_code

    assert main_code(["train", "--max-requeues", "-1", "--steps", "1"]) == 2
    assert "--max-requeues must not be negative, not -1" in capsys.readouterr().err
