"""oom.py: how the launcher tells a worker the out-of-memory killer killed from one killed otherwise."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from paratrain.runtime import oom


def test_the_kill_count_is_read_from_cgroup_v2_and_v1_files(tmp_path: Path) -> None:
    v2, v1, neither = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    for d in (v2, v1, neither):
        d.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom.oom_kills(v2) == 2 and oom.oom_kills(v1) == 7 and oom.oom_kills(neither) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cgroups are Linux's")
def test_this_process_memory_cgroup_is_found_where_the_machine_has_one() -> None:
    folders = oom.memory_cgroups(os.getpid())
    counted = [f for f in folders if oom.oom_kills(f) is not None]
    if not counted:
        pytest.skip(f"no memory controller readable here (cgroups {folders})")
    assert counted[0].is_dir() and str(counted[0]).startswith("/sys/fs/cgroup")


def test_a_kill_counts_only_when_the_count_grew_since_the_worker_was_first_seen_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline is the first count seen in each cgroup the worker was in: a worker the killer has hit but
    that has not exited yet is shown in the root cgroup (cgroup v1 moves an exiting task there), and must not
    hide its kill. A kill in a cgroup the worker was never in is not its."""
    a, b, root = tmp_path / "a", tmp_path / "b", tmp_path / "root"
    for d, n in ((a, 0), (b, 5), (root, 0)):
        d.mkdir()
        (d / "memory.oom_control").write_text(f"oom_kill {n}\n")
    where = {1: a, 2: b}
    monkeypatch.setattr(oom, "memory_cgroups", lambda pid: [where[pid]])
    watch = oom.OomWatch()
    watch.note([1, 2])
    (a / "memory.oom_control").write_text("oom_kill 1\n")  # the killer hits worker 1 ...
    watch.note([1])  # ... which is still seen alive in its cgroup (v2) ...
    where[1] = root  # ... and, exiting, in the root cgroup (v1)
    watch.note([1, 2])
    watch.note([1])
    assert watch.killed(1) == a
    assert watch.killed(2) is None  # a kill in a cgroup worker 2 never was in
    (b / "memory.oom_control").write_text("oom_kill 6\n")
    assert watch.killed(2) == b
    assert watch.killed(3) is None  # never seen: nothing can be known
