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
