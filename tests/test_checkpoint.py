"""Checkpoints survive a kill at any moment of a save."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain import checkpoint

WRITER = """
import sys, torch
from paratrain import checkpoint
folder = sys.argv[1]
step = 0
while True:
    step += 1
    big = torch.full((4_000_000,), float(step))  # 16 MB: a save takes long enough to be hit mid-way
    state = {"model": {"w": big}, "optimizer": {}, "step": step, "epoch": 0, "config": {"model": "x"}}
    checkpoint.save_step(state, folder, step, keep=2)
    print(step, flush=True)
"""


def _kill_during_saves(folder: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip()  # at least one save finished
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = checkpoint.load(folder / "last.pt")
        w = state["model"]["w"]
        assert w.shape == (4_000_000,) and bool((w == float(state["step"])).all())  # complete, one step
        assert len(list(folder.glob("step-*.pt"))) <= 3  # kept 2, plus at most the one being replaced


@pytest.mark.integration
def test_kill_during_saves_never_leaves_a_broken_last_pt(tmp_path: Path) -> None:
    _kill_during_saves(tmp_path / "checkpoints", kills=5, seed=0)


@pytest.mark.slow
def test_twenty_kills_during_saves(tmp_path: Path) -> None:
    """The fault-tolerance issue's count: kill -9 at 20 random moments of the saves."""
    _kill_during_saves(tmp_path / "checkpoints", kills=20, seed=1)


def test_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(3)}, "optimizer": {}, "step": 1, "epoch": 0, "config": {}}
    checkpoint.save(state, tmp_path / "a.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]
    assert torch.equal(checkpoint.load(tmp_path / "a.pt")["model"]["w"], torch.ones(3))


def test_without_hard_links_last_pt_is_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without hard links (some network and FUSE mounts): last.pt is a full copy of the step."""
    import os

    def no_links(*args: object) -> None:
        raise OSError("hard links are not supported here")

    monkeypatch.setattr(os, "link", no_links)
    state = {"model": {"w": torch.arange(3.0)}, "optimizer": {}, "step": 7, "epoch": 0, "config": {}}
    checkpoint.save_step(state, tmp_path, 7, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step-00000007.pt"]
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 7
    assert torch.equal(checkpoint.load(tmp_path / "last.pt")["model"]["w"], torch.arange(3.0))


def test_save_makes_folders_writes_beside_the_file_and_cleans_up_a_failed_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((Path(a).parent, Path(b))) or real_replace(a, b))
    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "step": 1, "epoch": 0, "config": {}}
    target = tmp_path / "a" / "b" / "c.pt"
    checkpoint.save(state, target)  # missing folders are made
    assert renames == [(target.parent, target)]  # the temporary file is in the same folder: the rename is atomic

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="No space left"):  # the writer's own error, not one from the clean-up
        checkpoint.save(state, tmp_path / "a" / "b" / "d.pt")
    assert sorted(p.name for p in target.parent.iterdir()) == ["c.pt"]  # no temporary file left


@pytest.mark.parametrize(("mine", "theirs", "expected_step", "expected_restarts"), [
    ((10, 0, None), (20, 1, None), 20, 1),  # the other node has the newer checkpoint and counted a restart
    ((20, 2, None), (10, 0, None), 20, 2),
    ((-1, 0, None), (-1, 3, None), None, 3),  # nobody has one: a fresh start, with the group's restart count
    ((15, 0, None), (15, 0, None), 15, 0),  # a tie: rank 0's, so every rank agrees on one
    ((10, 2, None), (20, 0, None), 20, 2),  # the newest checkpoint, not the node that restarted most
])
def test_the_group_carries_on_from_the_newest_checkpoint_any_worker_has(
        monkeypatch: pytest.MonkeyPatch, mine: tuple, theirs: tuple, expected_step: int | None,
        expected_restarts: int) -> None:
    """newest_in_group's choice, as rank 0 of 2 (the other rank's offer comes through a stand-in for the
    collectives; tests/test_faults.py runs it for real under torchrun)."""
    import torch.distributed as dist

    from paratrain.dist import DistContext

    def gather(offers: list, offer: tuple) -> None:
        assert offer == mine
        offers[:] = [mine, theirs]

    sent = []

    def broadcast(box: list, src: int) -> None:
        sent.append(src)
        if src != 0:
            box[0] = {"step": theirs[0], "from": "rank 1"}

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    ctx = DistContext(0, 2, torch.device("cpu"), "gloo")
    local = None if mine[0] < 0 else {"step": mine[0], "from": "rank 0"}
    chosen, restarts = checkpoint.newest_in_group(ctx, local, None, mine[1])
    assert restarts == expected_restarts
    assert (chosen["step"] if chosen else None) == expected_step
    if chosen is not None:
        assert chosen["from"] == ("rank 1" if theirs[0] > mine[0] else "rank 0") and len(sent) == 1
    else:
        assert sent == []  # nothing to send


def test_a_workers_problem_with_its_checkpoint_stops_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from paratrain import UserError
    from paratrain.dist import DistContext

    monkeypatch.setattr(dist, "all_gather_object",
                        lambda offers, offer: offers.__setitem__(slice(None), [offer, (-1, 0, "it is of model mlp")]))
    with pytest.raises(UserError, match="rank 1: it is of model mlp"):
        checkpoint.newest_in_group(DistContext(0, 2, torch.device("cpu"), "gloo"), None, None, 0)
    one = DistContext(0, 1, torch.device("cpu"), None)  # a single worker: its own checkpoint, or its problem
    assert checkpoint.newest_in_group(one, {"step": 3}, None, 2) == ({"step": 3}, 2)
    with pytest.raises(UserError, match="unreadable"):
        checkpoint.newest_in_group(one, None, "unreadable", 0)
