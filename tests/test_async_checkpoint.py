"""--async-checkpoint (checkpoint/background.py): the state saved is the state when the save was asked for,
whatever the training does while it is written; a failed background write is raised at the next wait; a kill at
any moment of a background save leaves the last complete checkpoint to carry on from; on 2 workers (ddp and fsdp,
Adam) the run ends with the weights, optimizer state and checkpoints of synchronous saves, and a run carried on
from its checkpoint too; the summary reports checkpoint_wait_s in both modes."""

from __future__ import annotations

import errno
import json
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import adam_moments, max_abs_diff, train_here, weights

from paratrain.checkpoint import dcp
from paratrain.checkpoint import files as checkpoint_files
from paratrain.checkpoint.manager import RunCheckpoints
from paratrain.core.errors import WriteFailed
from paratrain.runtime.dist import DistContext

ONE = DistContext(0, 1, torch.device("cpu"), None)


def test_a_background_sharded_save_holds_the_state_when_it_was_asked_for(tmp_path: Path) -> None:
    owner = RunCheckpoints(tmp_path, ONE, background=True)
    w = torch.ones(1_000_000)
    for step in (1, 2, 3):  # each save waits for the one before; the oldest is pruned
        owner.save_sharded(ONE, {"model": {"w": w}}, lambda s=step: {"step": s}, step, keep=2)
        w.add_(1)
    owner.wait()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000003"]  # no .tmp left
    assert bool((dcp.whole(folder / "step-00000003")["model"]["w"] == 3).all())
    assert torch.load(folder / "step-00000003" / dcp.META, weights_only=True)["step"] == 3
    assert owner.found().newest_step == 3 and owner.found().sharded


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    owner = RunCheckpoints(tmp_path, ONE, background=True)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    owner.save_sharded(ONE, {"model": {"w": torch.ones(3)}}, lambda: {"step": 1}, 1, keep=2)  # the write fails later
    with pytest.raises(WriteFailed, match=r"cannot write \S*step-00000001: No space left"):
        owner.wait()
    owner.wait()  # raised once
    assert not list((tmp_path / "checkpoints").iterdir())  # no hidden half folder left either


def test_one_process_saving_in_the_background_ends_as_saving_in_the_loop(tmp_path: Path) -> None:
    flags = ("--model", "mlp", "--width", "64", "--dataset", "digits", "--optimizer", "adam", "--steps", "20",
             "--checkpoint-every", "5", "--devices", "1", "--no-tensorboard")
    runs = {mode: train_here(tmp_path / mode, *flags, *extra)
            for mode, extra in (("sync", ()), ("async", ("--async-checkpoint",)))}
    assert max_abs_diff(weights(tmp_path / "sync"), weights(tmp_path / "async")) == 0.0
    for mode in runs:
        assert sorted(p.name for p in (tmp_path / mode / "checkpoints").iterdir()) == [
            "step-00000015", "step-00000020"]
        assert runs[mode]["checkpoint_wait_s"] > 0
    early = [dcp.whole(tmp_path / mode / "checkpoints" / "step-00000015", ("optimizer",))["optimizer"] for mode in runs]
    assert early[0] and max_abs_diff(early[0], early[1]) == 0.0


@pytest.mark.integration
def test_a_kill_during_background_saves_leaves_the_last_complete_checkpoint(tmp_path: Path) -> None:
    from saving_forks import SavingForks

    rng, forks = random.Random(3), SavingForks("background")
    try:
        for round_ in range(5):
            run = tmp_path / f"run{round_}"  # each round's own saves, counted from step 1
            pid = forks.start(run, steps=2)  # the first save is whole
            time.sleep(rng.uniform(0.0, 0.4))
            forks.kill(pid)
            state = checkpoint_files.newest_loadable(run / "checkpoints", whole=True)
            w = state["model"]["w"]
            assert w.shape == (4_000_000,) and bool((w == float(state["step"])).all())  # complete, one step
    finally:
        forks.close()


@pytest.mark.integration
@pytest.mark.matrix(("ddp", "async checkpoints", "0.0"), ("fsdp", "async checkpoints", "0.0"))
def test_two_workers_saving_in_the_background_end_and_carry_on_as_saving_in_the_loop(tmp_path: Path) -> None:
    """ddp and fsdp (every rank its part, DCP's async_save on a group of its own),
    Adam, a checkpoint every 5 steps: the same weights, Adam moments and checkpoints as synchronous saves, and a
    run carried on from a background save's checkpoint ends where an unbroken run does."""
    flags = ("--model", "mlp", "--width", "256", "--depth", "2", "--dataset", "digits", "--optimizer", "adam",
             "--checkpoint-every", "5", "--devices", "2", "--no-tensorboard")
    for strategy in ("ddp", "fsdp"):
        sync = train_here(tmp_path / f"{strategy}-sync", *flags, "--strategy", strategy, "--steps", "30")
        run = tmp_path / f"{strategy}-async"
        train_here(run, *flags, "--strategy", strategy, "--steps", "20", "--async-checkpoint")
        folder = run / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000015", "step-00000020"]
        carried = train_here(run, *flags, "--strategy", strategy, "--steps", "30", "--async-checkpoint",
                             "--resume", str(run))
        assert carried["resumed_from_step"] == 20 and carried["checkpoint_wait_s"] > 0
        assert sync["checkpoint_wait_s"] > 0
        assert max_abs_diff(weights(tmp_path / f"{strategy}-sync"), weights(run)) == 0.0, strategy
        ends = [dcp.whole(r / "checkpoints" / "step-00000030", ("optimizer",))["optimizer"]
                for r in (tmp_path / f"{strategy}-sync", run)]
        assert max_abs_diff(adam_moments({"optimizer": ends[0]}), adam_moments({"optimizer": ends[1]})) == 0.0
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 30
