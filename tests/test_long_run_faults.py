"""The faults a long run meets on 2 workers: a full disk, a worker the out-of-memory killer kills, a straggler.

Each test asserts the exit code, the one line (or the summary), that no process is left 10 s after the
launcher ended, and, where a checkpoint was written, the weights or the checkpoint that must survive. The
full disk is a small tmpfs and the memory limit a memory cgroup: both need root (and cgroups), and the tests
skip with the reason elsewhere. The network partition between two nodes is in test_two_nodes.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import alive, descendants, logged_step, max_abs_diff, train_here, training_workers, weights

from paratrain.checkpoint import files as checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # wall-time bounds: .ci/run runs it alone

# LeNet-5 on the embedded digits, 1 thread per worker; SGD with momentum, far from divergence.
TRAIN = ("--devices", "2", "--threads-per-worker", "1", "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9",
         "--batch-size", "64", "--no-tensorboard", "--quiet")


def _launch(run: Path, *args: str) -> subprocess.Popen:
    """`paratrain train` in a process group of its own (the test may stop the whole group)."""
    return subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--out", str(run), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(condition, launcher: subprocess.Popen, what: str, timeout: float = 120) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert launcher.poll() is None, f"the run ended before {what}: {launcher.communicate()[0][-3000:]}"
        if time.monotonic() > deadline:
            os.killpg(launcher.pid, signal.SIGKILL)  # no run of 100,000 steps left behind
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _end(launcher: subprocess.Popen, processes: list[int], timeout: float = 120) -> str:
    """The launcher's output once it has exited; asserts that no process of the run is left 10 s later."""
    try:
        output = launcher.communicate(timeout=timeout)[0]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if alive(p)], f"processes left 10 s after the run ended: {output[-2000:]}"
    return output


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("paratrain: error:")]


# ---- a full disk ----

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB file system of its own (a tmpfs), removed after."""
    point = tmp_path / "disk"
    point.mkdir()
    made = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(point)],
                                                capture_output=True).returncode == 0
    if not made:
        pytest.skip("a full disk needs a small file system of its own: mounting a tmpfs needs root")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last byte; the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (2**20, 2**12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_ends_the_run_in_one_line_keeps_the_last_checkpoint_and_is_not_restarted(
        small_disk: Path, tmp_path: Path) -> None:
    """The disk fills after the checkpoint of step 100: the checkpoint of step 200 cannot be written. The run
    ends with exit 1 and one line (the file, the cause, the checkpoint kept, how to go on); --max-restarts
    does not restart it; no partial file is left; once there is space again, --resume finishes the run with
    the weights of a run that never met a full disk."""
    run = small_disk / "run"
    args = (*TRAIN, "--steps", "400", "--checkpoint-every", "100", "--log-every", "400")
    launcher = _launch(run, *args, "--max-restarts", "2")
    _wait_for(lambda: (run / "checkpoints" / "step-00000100").exists(), launcher, "the checkpoint of step 100")
    os.killpg(launcher.pid, signal.SIGSTOP)  # the whole run holds still while the disk fills: no race
    filler = _fill(small_disk)
    os.killpg(launcher.pid, signal.SIGCONT)
    processes = [launcher.pid, *descendants(launcher.pid)]
    output = _end(launcher, processes)
    assert launcher.returncode == 1, output[-3000:]
    assert _error_lines(output) == [
        f"paratrain: error: cannot write {run}/checkpoints/step-00000200: No space left on device (ENOSPC); the "
        f"last good checkpoint is step-00000100 (step 100) in {run}/checkpoints; free space and continue with "
        f"--resume {run}"], output[-3000:]
    assert "restarting" not in output and "Traceback" not in output, output[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000100"]
    assert checkpoint.load(run)["step"] == 100
    filler.unlink()
    summary = train_here(run, *args, "--resume", str(run))
    assert summary["steps"] == 400 and summary["resumed_from_step"] == 100
    train_here(tmp_path / "whole", *args)
    assert max_abs_diff(weights(run), weights(tmp_path / "whole")) <= 1e-6


def test_a_run_folder_that_fills_before_the_first_checkpoint_says_none_was_kept(small_disk: Path) -> None:
    """The disk fills at step 5, before the first checkpoint: metrics.jsonl (a line every step) cannot grow.
    One line, exit 1, and it says that no checkpoint was kept."""
    run = small_disk / "run"
    launcher = _launch(run, *TRAIN, "--steps", "400", "--checkpoint-every", "300", "--log-every", "1")
    _wait_for(lambda: logged_step(run) >= 5, launcher, "step 5")
    os.killpg(launcher.pid, signal.SIGSTOP)
    _fill(small_disk)
    os.killpg(launcher.pid, signal.SIGCONT)
    output = _end(launcher, [launcher.pid, *descendants(launcher.pid)])
    assert launcher.returncode == 1, output[-3000:]
    [line] = _error_lines(output)
    assert line.startswith(f"paratrain: error: cannot write {run}/metrics.jsonl: No space left on device (ENOSPC); "
                           "no checkpoint was kept"), line
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


# ---- the out-of-memory killer ----

LEAKY = '''
import time

import torch
from torch import nn


class Leaky(nn.Module):
    """A network whose forward keeps 256 KiB a step, as a leak in a user's code would."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)
        self.kept = []

    def forward(self, x):
        if self.training:
            self.kept.append(torch.ones(2**16))
            time.sleep(0.005)  # ~100 steps a second: the leak grows at ~25 MiB/s
        return self.fc(x.flatten(1))


def build():
    return Leaky()
'''


def _memory_cgroup() -> tuple[Path, str, str] | None:
    """A new memory cgroup: (its folder, its limit file, its usage file); None where none can be made."""
    name = f"paratrain-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            (v1 / name).mkdir()
            return v1 / name, "memory.limit_in_bytes", "memory.usage_in_bytes"
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            (v2 / name).mkdir()
            return v2 / name, "memory.max", "memory.current"
    except OSError:
        pass
    return None


def test_a_worker_killed_by_the_out_of_memory_killer_is_named_with_its_step_and_not_restarted(tmp_path: Path) -> None:
    """Worker 1 is moved into a memory cgroup, whose limit is then set 16 MiB above what it holds; its leak
    reaches the limit and the kernel's OOM killer kills it. One line names the worker, the step and what to
    lower; exit 1; --max-restarts does not restart it (it would be killed again)."""
    cgroup = _memory_cgroup() if os.geteuid() == 0 else None
    if cgroup is None:
        pytest.skip("an out-of-memory kill needs a memory cgroup of its own: root and a memory controller")
    folder, limit, usage = cgroup
    (tmp_path / "leaky.py").write_text(LEAKY)
    run = tmp_path / "run"
    try:
        launcher = _launch(run, *TRAIN, "--model", f"{tmp_path / 'leaky.py'}:build", "--steps", "100000",
                           "--log-every", "1", "--checkpoint-every", "100000", "--max-restarts", "2")
        _wait_for(lambda: logged_step(run) >= 5, launcher, "step 5")
        processes = [launcher.pid, *descendants(launcher.pid)]
        victim = training_workers(launcher.pid)[1]
        (folder / "cgroup.procs").write_text(str(victim))
        time.sleep(1.5)  # the launcher notes each worker's cgroup every 0.5 s
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # 16 MiB above what it holds now (it grows: a limit below is refused)
            try:
                (folder / limit).write_text(str(int((folder / usage).read_text()) + 16 * 2**20))
                break
            except OSError:
                continue
        if (folder / "memory.memsw.limit_in_bytes").exists():  # v1: no swapping out of it either
            (folder / "memory.memsw.limit_in_bytes").write_text((folder / limit).read_text())
        elif (folder / "memory.swap.max").exists():
            (folder / "memory.swap.max").write_text("0")
        output = _end(launcher, processes)
        assert launcher.returncode == 1, output[-3000:]
        [line] = _error_lines(output)
        found = re.fullmatch(rf"paratrain: error: worker 1 was killed by the out-of-memory killer after step "
                             rf"(\d+) \(its memory cgroup {folder} counts the kill\); lower --batch-size \(and raise "
                             r"--accumulate by the same factor to keep the update's size\), or give the workers more "
                             r"memory", line)
        assert found and int(found[1]) >= 5, line
        assert "restarting" not in output, output[-3000:]
    finally:
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:  # empty once its process is gone
            try:
                folder.rmdir()
            except OSError:
                time.sleep(0.1)


# ---- a straggler ----

def test_a_straggler_changes_no_weight_and_the_summary_names_it(tmp_path: Path) -> None:
    """Worker 1 is stopped for 0.5 s twenty times mid-run (SIGSTOP/SIGCONT, as a busy or throttled machine
    would): the weights equal an undisturbed run's, and summary.json says that worker 0 waited seconds for
    worker 1 at the steps' synchronisation, and that worker 1 held it back."""
    args = (*TRAIN, "--steps", "1000", "--log-every", "10", "--checkpoint-every", "200")
    run = tmp_path / "straggler"
    launcher = _launch(run, *args)
    _wait_for(lambda: logged_step(run) >= 20, launcher, "step 20")
    processes = [launcher.pid, *descendants(launcher.pid)]
    victim = training_workers(launcher.pid)[1]
    for _ in range(20):  # 10 s stopped; the worker runs about a tenth of that time: some 150 of its steps
        os.kill(victim, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(victim, signal.SIGCONT)
        time.sleep(0.05)
    assert launcher.poll() is None, "the bursts must land before the run ends: lengthen it"
    output = _end(launcher, processes)
    assert launcher.returncode == 0, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    waited = summary["sync_wait_s"]
    # 10 s stopped; a stop that lands while worker 1 is in a collective counts for no one: a quarter to a half
    # of it here (10 s stopped gave worker 0 2.8 to 5.7 s, worker 1 0.25 to 0.42 s)
    assert waited[0] - waited[1] >= 2.0, waited
    assert summary["straggler"] == 1
    train_here(tmp_path / "calm", *args)
    assert max_abs_diff(weights(run), weights(tmp_path / "calm")) == 0.0
    calm = json.loads((tmp_path / "calm" / "summary.json").read_text())
    assert calm["straggler"] is None and len(calm["sync_wait_s"]) == 2
