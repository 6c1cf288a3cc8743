"""Checkpoints survive a kill at any moment of a save."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import save_earlier_release_step, save_step

from paratrain.checkpoint import files as checkpoint
from paratrain.core.errors import UserError, WriteFailed
from paratrain.parallel import strategies


def _kill_during_saves(folder: Path, kills: int, seed: int) -> None:
    from saving_forks import SavingForks

    rng, forks = random.Random(seed), SavingForks("dcp")
    try:
        for _ in range(kills):
            pid = forks.start(folder, steps=1)  # at least one save finished
            time.sleep(rng.uniform(0.0, 0.4))
            forks.kill(pid)
            state = checkpoint.newest_loadable(folder)  # the newest step folder, read whole: never a broken one
            w = state["model"]["w"]
            assert w.shape == (4_000_000,) and bool((w == float(state["step"])).all())  # complete, one step
            assert 1 <= len(list(folder.glob("step-*"))) <= 3  # kept 2, plus at most the one being pruned
    finally:
        forks.close()


@pytest.mark.integration
def test_kill_during_saves_never_leaves_a_broken_checkpoint(tmp_path: Path) -> None:
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
    # the writer's own error, not one from the clean-up, naming the file and not its temporary name
    with pytest.raises(WriteFailed, match=r"cannot write \S*/b/d\.pt: No space left on device \(ENOSPC\)"):
        checkpoint.save(state, tmp_path / "a" / "b" / "d.pt")
    assert sorted(p.name for p in target.parent.iterdir()) == ["c.pt"]  # no temporary file left


def test_a_full_disk_under_torch_save_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected pos": the OSError
    it was raised over is what the user is told (an export's file); a step folder's failed write names the step
    and leaves the steps before it as they were."""
    import errno
    import os

    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "step": 3, "epoch": 0, "config": {}}
    save_step(state, tmp_path, 3)
    real_fdopen, real_fsync = os.fdopen, os.fsync

    class Full:  # the checkpoint's file on a disk that fills up: torch.save's writes fail
        def __init__(self, f: object) -> None:
            self.f = f

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> object:
            return getattr(self.f, name)

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(WriteFailed, match="model.pt: No space left on device"):
        checkpoint.save(state, tmp_path / "model.pt")
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(WriteFailed, match=r"step-00000005: Disk quota exceeded \(EDQUOT\)"):
        save_step({**state, "step": 5}, tmp_path, 5)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]  # no hidden half folder left
    assert checkpoint.newest_loadable(tmp_path)["step"] == 3


@pytest.mark.parametrize(("mine", "theirs", "expected_step", "expected_restarts"), [
    ((10, 0, None), (20, 1, None), 20, 1),  # the other node has the newer checkpoint and counted a restart
    ((20, 2, None), (10, 0, None), 20, 2),
    ((-1, 0, None), (-1, 3, None), None, 3),  # nobody has one: a fresh start, with the group's restart count
    ((15, 0, None), (15, 0, None), 15, 0),  # the same step on both disks: each keeps its own, nothing is sent
    ((10, 2, None), (20, 0, None), 20, 2),  # the newest checkpoint, not the node that restarted most
])
def test_the_group_carries_on_from_the_newest_checkpoint_any_worker_has(
        monkeypatch: pytest.MonkeyPatch, mine: tuple, theirs: tuple, expected_step: int | None,
        expected_restarts: int) -> None:
    """agree's choice, as rank 0 of 2 (the other rank's offer comes through stand-ins for the collectives;
    tests/test_faults.py runs it for real under torchrun): only a rank that lacks the newest step is sent it."""
    import torch.distributed as dist

    from paratrain.runtime.dist import DistContext

    def gather(offers: list, offer: tuple) -> None:
        assert offer == mine
        offers[:] = [mine, theirs]

    sent, received = [], []

    def send(box: list, dst: int) -> None:
        sent.append((box[0]["from"], dst))

    def recv(box: list, src: int) -> None:
        received.append(src)
        box[0] = {"step": theirs[0], "from": "rank 1"}

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "send_object_list", send)
    monkeypatch.setattr(dist, "recv_object_list", recv)
    ctx = DistContext(0, 2, torch.device("cpu"), "gloo")
    local = None if mine[0] < 0 else {"step": mine[0], "from": "rank 0"}
    chosen, restarts = checkpoint.agree(ctx, local, None, mine[1])
    assert restarts == expected_restarts
    assert (chosen["step"] if chosen else None) == expected_step
    if expected_step is None or mine[0] == theirs[0]:
        assert sent == received == []  # nothing to send: nobody has one, or both read the same step
    elif theirs[0] > mine[0]:
        assert chosen["from"] == "rank 1" and received == [1] and sent == []
    else:
        assert chosen["from"] == "rank 0" and sent == [("rank 0", 1)] and received == []


def _saved_at_step_7(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A layer after one AdamW step (lr 0.01), saved as a run saves step 7 into `folder`; the layer and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from paratrain.checkpoint import dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    weights, state = get_state_dict(model, optimizer, options=dcp.state_dict_options())
    save_step({"model": weights, "optimizer": state, "step": 7, "epoch": 0, "config": {"model": "x"}}, folder, 7)
    return model, optimizer


def test_a_step_folder_is_sent_whole_to_a_rank_whose_disk_lacks_it(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """Under ddp rank 0 writes each step folder alone, on its node's disk; a rank on another node carries on from
    what the holder sends: the folder's meta.pt values with its tensors whole, the optimizer's values too."""
    import torch.distributed as dist

    from paratrain.runtime.dist import DistContext

    model, optimizer = _saved_at_step_7(tmp_path)
    local = checkpoint.newest_loadable(tmp_path, whole=False)  # as a worker reads it: its tensors left on disk
    assert "model" not in local
    sent: list = []
    monkeypatch.setattr(dist, "all_gather_object", lambda offers, offer: offers.__setitem__(slice(None),
                                                                                          [offer, (-1, 0, None)]))
    monkeypatch.setattr(dist, "send_object_list", lambda box, dst: sent.append((box[0], dst)))
    chosen, _ = checkpoint.agree(DistContext(0, 2, torch.device("cpu"), "gloo"), local, None, 0)
    assert chosen is local  # the holder reads its own disk
    (whole, to), = sent
    assert to == 1 and whole["step"] == 7 and whole["sharded"] == local["sharded"]
    assert torch.equal(whole["model"]["weight"], model.weight.detach())
    assert torch.equal(whole["optimizer"]["state.weight.exp_avg"], optimizer.state[model.weight]["exp_avg"])
    assert whole["optimizer"]["param_groups.weight.lr"] == optimizer.param_groups[0]["lr"]


def test_a_workers_part_of_an_earlier_releases_whole_model_file_is_read_by_name_or_refused_in_one_line() -> None:
    """A worker that holds a part of the model (here tensor parallelism's one worker, through the composition's
    path for parts) takes its weights out of an earlier release's whole-model file by name; a file of a model
    built with another width is refused in one line that names the option, as a whole copy's is."""
    from torch import nn

    from paratrain.config import TrainConfig
    from paratrain.parallel.layout import Layout
    from paratrain.parallel.mesh import Mesh
    from paratrain.runtime.dist import DistContext

    def net(width: int) -> nn.Module:
        torch.manual_seed(width)
        return nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, 3))

    strategy = strategies.get("tp")(DistContext(0, 1, torch.device("cpu"), None),
                                    TrainConfig(strategy="tp", width=8, resume="old-run"), Layout("tp", Mesh()))
    strategy.module = net(8)
    with pytest.raises(UserError, match=r"checkpoint old-run holds a mlp built with width 4; resume it without "
                                        r"changing --width"):
        strategy.load({"model": net(4).state_dict(), "config": {"model": "mlp", "width": 4}})
    strategy.module = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))  # other initial weights
    strategy.load({"model": net(8).state_dict(), "config": {"model": "mlp", "width": 8}})
    assert all(torch.equal(v, net(8).state_dict()[k]) for k, v in strategy.module.state_dict().items())


def test_a_ddp_worker_carries_on_from_a_step_folder_sent_whole(tmp_path: Path) -> None:
    """What a rank whose disk lacks the folder was sent (agree): its weights and optimizer state loaded as from
    the folder, without reading it."""
    import shutil

    from paratrain.checkpoint import dcp
    from paratrain.config import TrainConfig
    from paratrain.parallel.strategies.names import DDP
    from paratrain.runtime.dist import DistContext

    model, optimizer = _saved_at_step_7(tmp_path)
    local = checkpoint.newest_loadable(tmp_path, whole=False)
    sent = {**local, **dcp.whole(local["sharded"], dcp.TENSORS, values=True)}
    shutil.rmtree(local["sharded"])  # not on this worker's disk
    strategy = DDP(DistContext(0, 1, torch.device("cpu"), None), TrainConfig())
    strategy.module = torch.nn.Linear(2, 3)
    fresh = torch.optim.AdamW(strategy.module.parameters(), lr=0.5)
    strategy.load(sent)
    strategy.restore(fresh, None, sent)
    assert torch.equal(strategy.module.weight, model.weight) and fresh.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh.state[strategy.module.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"])


def test_a_workers_problem_with_its_checkpoint_stops_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from paratrain import UserError
    from paratrain.runtime.dist import DistContext

    monkeypatch.setattr(dist, "all_gather_object",
                        lambda offers, offer: offers.__setitem__(slice(None), [offer, (-1, 0, "it is of model mlp")]))
    with pytest.raises(UserError, match="rank 1: it is of model mlp"):
        checkpoint.agree(DistContext(0, 2, torch.device("cpu"), "gloo"), None, None, 0)
    one = DistContext(0, 1, torch.device("cpu"), None)  # a single worker: its own checkpoint, or its problem
    assert checkpoint.agree(one, {"step": 3}, None, 2) == ({"step": 3}, 2)
    with pytest.raises(UserError, match="unreadable"):
        checkpoint.agree(one, None, "unreadable", 0)


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "step": step, "epoch": 0,
            "config": {"model": "x"}}


def _save(folder: Path, step: int, keep: int = 2) -> None:
    save_step(_state(step), folder, step, keep=keep)


def _truncate(path: Path) -> None:
    """Cut a checkpoint short: a file (an earlier release's), or a step folder's tensors."""
    for file in [path] if path.is_file() else path.glob("*.distcp"):
        with open(file, "r+b") as f:  # in place: an earlier release's last.pt and its step file are one file
            f.truncate(100)


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    for step in (10, 20):
        _save(tmp_path / "checkpoints", step)
    _truncate(tmp_path / "checkpoints" / "step-00000020")
    assert checkpoint.load(tmp_path)["step"] == 10  # a run directory: the newest that loads
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "skipped step-00000020 " in line and "using step-00000010, step 10" in line
    assert "incomplete" in line
    assert checkpoint.newest_loadable(tmp_path / "checkpoints")["step"] == 10
    assert checkpoint.newest_loadable(tmp_path / "none") is None


def test_an_earlier_releases_files_are_read_newest_step_first_and_a_damaged_one_falls_back(tmp_path: Path) -> None:
    """Before every layout wrote step folders, ddp wrote step-N.pt and linked last.pt to it: a kill between the
    two left last.pt on the step before; the newest step file wins. Damaged, it falls back to the one before."""
    import os

    for step in (10, 20):
        save_earlier_release_step(_state(step), tmp_path, step)
    (tmp_path / "last.pt").unlink()
    os.link(tmp_path / "step-00000010.pt", tmp_path / "last.pt")
    assert checkpoint.newest_loadable(tmp_path)["step"] == 20
    assert checkpoint.load(tmp_path / "step-00000020.pt")["model"]["w"][0] == 20  # read whole, in this process
    _truncate(tmp_path / "step-00000020.pt")
    assert checkpoint.newest_loadable(tmp_path)["step"] == 10
    # on a file system without hard links last.pt was a copy: read where no step file is left
    for path in tmp_path.glob("step-*.pt"):
        path.unlink()
    (tmp_path / "last.pt").unlink()
    checkpoint.save(_state(30), tmp_path / "last.pt")
    assert checkpoint.newest_loadable(tmp_path)["step"] == 30


def test_when_no_checkpoint_loads_the_error_says_so_in_one_line(tmp_path: Path) -> None:
    from paratrain.core.errors import UserError

    for step in (10, 20):
        _save(tmp_path / "checkpoints", step)
    for path in (tmp_path / "checkpoints").glob("step-*"):
        _truncate(path)
    with pytest.raises(UserError, match=r"no checkpoint in .*checkpoints loads: checkpoint .*step-00000020 is "
                                        r"incomplete.*\(and 1 other checkpoint\(s\) there\); start a new run, or "
                                        r"restore its checkpoints from a copy$") as refused:
        checkpoint.load(tmp_path)
    assert "use another one" not in str(refused.value)  # none is left to use


def test_two_step_checkpoints_are_kept_by_default() -> None:
    from paratrain.config import TrainConfig

    assert TrainConfig().keep_checkpoints == 2


def test_a_resume_refused_before_its_first_step_leaves_the_runs_record_as_it_was(
        tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Every checkpoint of a run damaged: carrying it on under other options is refused in one line (exit 2), and
    its config.yaml still holds the options it ran with, not the refused ones (a new user's trial found them
    written: a later --resume would have carried the run on under options that never ran)."""
    from conftest import main_code, train_here

    run = tmp_path / "run"
    train_here(run, "--devices", "1", "--steps", "6", "--checkpoint-every", "3", "--seed", "5")
    before = (run / "config.yaml").read_text()
    for folder in (run / "checkpoints").glob("step-*"):
        _truncate(folder)
    assert main_code(["train", "--quiet", "--resume", str(run), "--steps", "12", "--keep-checkpoints", "5"]) == 2
    assert "no checkpoint in" in capfd.readouterr().err
    assert (run / "config.yaml").read_text() == before


@pytest.mark.integration
def test_a_run_whose_newest_checkpoint_is_damaged_is_evaluated_and_resumed_on_two_workers_from_the_one_before(
        tmp_path: Path) -> None:
    import json

    from conftest import run_cli, train

    run = tmp_path / "run"
    train(run, "--devices", "2", "--steps", "20", "--checkpoint-every", "5", "--optimizer", "sgd", "--lr", "0.01")
    _truncate(run / "checkpoints" / "step-00000020")
    evaluated = run_cli("eval", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert "skipped step-00000020 " in evaluated.stderr and "using step-00000015," in evaluated.stderr
    resumed = run_cli("train", "--quiet", "--resume", str(run), "--steps", "25")
    assert resumed.returncode == 0, resumed.stderr
    # said once (by one of the two workers), without advice to use another one: it says which one is used
    [said] = [line for line in resumed.stderr.splitlines() if "skipped step-00000020 " in line]
    assert "use another one" not in said and "using step-00000015, step 15" in said, said
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 15 and summary["steps"] == 25
    # step 20, passed again, was written anew whole (not its record over the damaged shards): it loads
    from paratrain.checkpoint import files as checkpoint

    assert checkpoint.load(run / "checkpoints" / "step-00000020")["step"] == 20


# ---- the one owner of a run's checkpoints (checkpoint/manager.py) ----


def test_the_owner_lists_the_folder_once_and_knows_the_newest_step_and_its_form(tmp_path: Path,
                                                                                 monkeypatch) -> None:  # noqa: ANN001
    from paratrain.checkpoint import manager

    listed = []
    real = manager.step_checkpoints
    monkeypatch.setattr(manager, "step_checkpoints", lambda folder: listed.append(folder) or real(folder))
    (tmp_path / "checkpoints" / "step-00000003").mkdir(parents=True)  # a sharded step folder, the newest
    (tmp_path / "checkpoints" / "step-00000002.pt").write_bytes(b"")
    owner = manager.RunCheckpoints(tmp_path)
    assert owner.found() == manager.Found(newest_step=3, sharded=True, weights_only=False)
    owner.check_form("fsdp", strategies.get("fsdp").reads_whole_files)  # fsdp reads a sharded checkpoint
    owner.check_form("ddp", strategies.get("ddp").reads_whole_files)
    assert owner.why_not_resumable() is None
    assert len(listed) == 1  # every question answered from one listing
    assert manager.RunCheckpoints(tmp_path / "fresh").found() == manager.Found()


def test_the_owner_refuses_a_whole_model_file_to_fsdp_and_a_trials_weights_to_resume(tmp_path: Path) -> None:
    from paratrain.checkpoint import manager
    from paratrain.checkpoint.run_folder import WEIGHTS_ONLY

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000004.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / WEIGHTS_ONLY).write_text("weights")
    owner = manager.RunCheckpoints(tmp_path)
    with pytest.raises(UserError, match="holds one whole-model file of an earlier release, which --strategy hsdp "
                                        "does not read"):
        owner.check_form("hsdp", strategies.get("hsdp").reads_whole_files)
    owner.check_form("pipeline", strategies.get("pipeline").reads_whole_files)
    assert "kept only its weights" in owner.why_not_resumable()


def test_the_owner_saves_a_step_prunes_the_old_and_lists_anew(tmp_path: Path) -> None:
    from paratrain.checkpoint import manager
    from paratrain.runtime.dist import DistContext

    owner = manager.RunCheckpoints(tmp_path)
    assert owner.found().newest_step is None
    one = DistContext(0, 1, torch.device("cpu"), None)
    for step in (1, 2, 3):
        owner.save_sharded(one, {"model": {"w": torch.ones(1) * step}},
                           lambda s=step: {"optimizer": None, "step": s, "epoch": 0, "config": {}}, step, keep=2)
        assert owner.found().newest_step == step and owner.found().sharded  # listed anew after each save
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    assert checkpoint.load(tmp_path)["model"]["w"].item() == 3


def test_a_step_saved_again_replaces_the_folder_left_there_whole(tmp_path: Path) -> None:
    """A run carried on from step 2, past a damaged step-3 folder (a new user's trial): its step 3 is written
    anew, shards and record, not the record alone over the damaged shards."""
    from paratrain.checkpoint import manager
    from paratrain.runtime.dist import DistContext

    owner = manager.RunCheckpoints(tmp_path)
    one = DistContext(0, 1, torch.device("cpu"), None)
    for step, value in ((2, 2.0), (3, 3.0)):
        owner.save_sharded(one, {"model": {"w": torch.full((4,), value)}},
                           lambda s=step: {"optimizer": None, "step": s, "epoch": 0, "config": {}}, step, keep=2)
    shard = next((tmp_path / "checkpoints" / "step-00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])  # damaged: the run carries on from step 2
    assert checkpoint.load(tmp_path)["step"] == 2
    owner.save_sharded(one, {"model": {"w": torch.full((4,), 30.0)}},
                       lambda: {"optimizer": None, "step": 3, "epoch": 0, "config": {}}, 3, keep=2)
    state = checkpoint.load(tmp_path / "checkpoints" / "step-00000003")
    assert state["step"] == 3 and state["model"]["w"].tolist() == [30.0] * 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("stop", ["end", "early-stopping"])
def test_each_step_is_saved_once(tmp_path: Path, stop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint-every 1: every step is written, each once, to the run's end or the step it stopped early at
    (the last step's periodic save and the end's were two writes of one step); the run carries on from it."""
    from conftest import main_code

    from paratrain.checkpoint import manager

    saved: list[int] = []
    write = manager.RunCheckpoints.save_sharded

    def counted(self, ctx, tensors, meta, step, keep):  # noqa: ANN001, ANN202
        saved.append(step)
        write(self, ctx, tensors, meta, step, keep)

    monkeypatch.setattr(manager.RunCheckpoints, "save_sharded", counted)
    args = ["--steps", "4"] if stop == "end" else ["--epochs", "20", "--early-stopping", "1", "--lr", "1"]
    run = tmp_path / "run"
    assert main_code(["train", "--quiet", "--devices", "1", "--batch-size", "512", "--checkpoint-every", "1",
                      "--out", str(run), *args]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert saved == list(range(1, summary["steps"] + 1)), saved  # each step once, in order
    if stop == "early-stopping":
        assert summary["epochs"] < 20  # it stopped early; carried on, it stays stopped (validated again)
        assert main_code(["train", "--quiet", "--resume", str(run)]) == 0
        assert json.loads((run / "summary.json").read_text())["steps"] == summary["steps"]
