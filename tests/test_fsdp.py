"""Sharded data parallelism in one process: the sharded checkpoint's folder (written whole or not at all,
read whole or into shards), evaluation in lock-step, the options fsdp and hsdp refuse, a one-worker fsdp run
resumed exactly, `paratrain export`, and summary.json's model_state_bytes. The several-worker promises
(equivalence, resharding resumes, kill -9) are in test_fsdp_workers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import earlier_release, main_code, max_abs_diff, save_earlier_release_step, weights
from torch import nn

from paratrain.checkpoint import dcp as sharded
from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint.run_folder import step_checkpoints
from paratrain.core.errors import UserError
from paratrain.optimization.evaluation import evaluate
from paratrain.runtime.dist import DistContext

ONE = DistContext(0, 1, torch.device("cpu"), None)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, step: int, keep: int = 2) -> Path:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights_, state = get_state_dict(model, optimizer, options=sharded.state_dict_options())
    meta = {"step": step, "epoch": 0, "config": {"model": "custom"}}
    return sharded.save_step(ONE, {"model": weights_, "optimizer": state}, lambda: meta, folder, step, keep)


def test_a_sharded_checkpoint_is_a_step_folder_read_whole_or_left_to_the_strategy(tmp_path: Path) -> None:
    model, optimizer = _trained()
    folders = [_save(model, optimizer, tmp_path, step, keep=2) for step in (10, 20, 30)]
    assert [p.name for _, p in step_checkpoints(tmp_path)] == ["step-00000020", "step-00000030"]  # kept 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]  # no .tmp left over
    _save(model, optimizer, tmp_path, 30)  # the same step again (a finished run's last save) replaces it
    whole = checkpoint.load(folders[-1])
    assert whole["step"] == 30 and whole["sharded"] == str(folders[-1]) and whole["torch"] == str(torch.__version__)
    assert max_abs_diff(whole["model"], model.state_dict()) == 0.0
    lean = checkpoint.newest_loadable(tmp_path, whole=False)  # a worker's: the tensors are its strategy's to read
    assert lean["step"] == 30 and "model" not in lean and lean["sharded"] == str(folders[-1])
    moments = sharded.whole(folders[-1], ("optimizer",))["optimizer"]
    assert max_abs_diff({k: v for k, v in moments.items() if k.endswith("exp_avg")},
                        {f"state.{n}.exp_avg": optimizer.state[p]["exp_avg"]
                         for n, p in model.named_parameters()}) == 0.0


class _Code:
    """An object whose unpickling calls a function: what a hostile checkpoint would hold."""

    def __reduce__(self) -> tuple:
        return (print, ("ran the checkpoint's code",))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, saving in this one process
def test_a_sharded_checkpoint_whose_pickles_carry_code_is_refused(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "hostile"
    dcp.save({"model": {"w": torch.ones(2)}, "optimizer": {"param_groups.w.lr": _Code()}}, checkpoint_id=folder,
             no_dist=True)
    with pytest.raises(UserError, match=r"could not be read .*Weights only load failed"):
        sharded.read(folder, {"optimizer": {"param_groups.w.lr": 0.1}}, distributed=False)
    assert "ran the checkpoint's code" not in capsys.readouterr().out


def test_a_run_of_an_earlier_release_carried_on_leaves_no_last_pt_naming_an_older_step(tmp_path: Path) -> None:
    """An earlier release's ddp wrote step-N.pt files and last.pt; carried on, the run writes step folders: the
    same step's file goes, and last.pt with it, so no name points at an older step than the newest."""
    model, optimizer = _trained()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 30, "epoch": 0, "config": {}}
    save_earlier_release_step(state, tmp_path, 20)
    save_earlier_release_step(state, tmp_path, 30)
    _save(model, optimizer, tmp_path, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020.pt", "step-00000030"]
    _save(model, optimizer, tmp_path, 40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]
    assert checkpoint.newest_loadable(tmp_path)["step"] == 40


def test_a_checkpoint_of_fsdps_first_release_is_read_as_it_was_written(tmp_path: Path) -> None:
    """Its optimizer state was not flattened (the parameter groups one list): any strategy reads it still."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from paratrain.config import TrainConfig
    from paratrain.parallel.strategies.base import Strategy

    model, optimizer = _trained()
    weights_, state = get_state_dict(model, optimizer)  # as fsdp saved before the pipelines shared its format
    meta = {"step": 5, "epoch": 0, "config": {"model": "custom"}}
    folder = sharded.save_step(ONE, {"model": weights_, "optimizer": state}, lambda: meta, tmp_path, 5, 2)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    again = torch.optim.Adam(fresh.parameters(), lr=0.5)
    strategy = Strategy(ONE, TrainConfig())
    strategy.module = fresh
    saved = checkpoint.load(folder, whole=False)
    strategy.load(saved)
    strategy.restore(again, None, saved)
    assert max_abs_diff(fresh.state_dict(), model.state_dict()) == 0.0 and again.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(again.state[q]["exp_avg"], optimizer.state[p]["exp_avg"])
               for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


def test_a_sharded_checkpoint_of_a_newer_torch_is_refused_in_one_line(tmp_path: Path) -> None:
    model, optimizer = _trained()
    folder = _save(model, optimizer, tmp_path, 5)
    meta = torch.load(folder / sharded.META, weights_only=True)
    torch.save({**meta, "torch": "99.1.0"}, folder / sharded.META)
    with pytest.raises(UserError, match=r"written by torch 99.1.0, newer than this torch .*install torch>=99.1.0"):
        checkpoint.load(folder)


def test_a_folder_that_lost_or_cut_a_shard_is_passed_over_for_the_one_before(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    model, optimizer = _trained()
    _save(model, optimizer, tmp_path, 5)
    newest = _save(model, optimizer, tmp_path, 10)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short (a full disk, a copy cut off)
    with pytest.raises(UserError, match=r"step-00000010 is incomplete \(__0_0.distcp is missing or cut short\)"):
        checkpoint.load(newest, whole=False)
    assert checkpoint.newest_loadable(tmp_path, whole=False)["step"] == 5  # what a resume carries on from
    assert "skipped step-00000010" in capsys.readouterr().err
    shard.unlink()
    with pytest.raises(UserError, match="is incomplete"):
        checkpoint.load(newest)
    (newest / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match=r"is unreadable \(its .metadata: "):
        checkpoint.load(newest)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x.flatten(1))


@pytest.mark.parametrize("lockstep", [False, True])
def test_evaluation_in_lockstep_runs_as_many_forwards_on_every_worker(lockstep: bool) -> None:
    """10 examples over 3 workers, 3 a batch: shares of 4, 3, 3 take 2, 1, 1 batches; in lock-step (a sharded
    model's every forward is a collective) each runs 2, the shorter shares an empty batch, counted nowhere."""
    from paratrain.data.transforms import BatchPipeline

    x, y = torch.randn(10, 1, 2, 2), torch.randint(0, 3, (10,))
    prep = BatchPipeline((0.0,), (1.0,), 2, torch.device("cpu"))
    calls, sums = [], []
    for rank in range(3):
        torch.manual_seed(0)
        model = _Counting()
        ctx = DistContext(rank, 3, torch.device("cpu"), None)  # no group: each share's own figures
        sums.append(evaluate(model, (x, y), prep, ctx, 3, lockstep=lockstep))
        calls.append(model.calls)
    assert calls == ([2, 2, 2] if lockstep else [2, 1, 1])
    plain = []
    for rank in range(3):
        torch.manual_seed(0)
        plain.append(evaluate(_Counting(), (x, y), prep, DistContext(rank, 3, torch.device("cpu"), None), 3))
    assert sums == plain  # the empty batches add nothing (and no NaN)


@pytest.mark.parametrize(("args", "message"), [
    (("--strategy", "fsdp", "--precision", "16-mixed"), "not available with --strategy fsdp (FSDP casts"),
    (("--strategy", "fsdp", "--shard-size", "2"), "--shard-size is for --strategy hsdp"),
    (("--strategy", "hsdp", "--shard-size", "3", "--devices", "2"), "--shard-size 3 does not divide the 2 workers"),
    (("--strategy", "fsdp", "--shard-modules", "0,body"), "--shard-modules names 'body', which this network does"),
    (("--strategy", "fsdp", "--cpu-offload"), "--cpu-offload moves the shards off the GPUs"),
    (("--strategy", "fsdp", "--stages", "2"), "--stages is for --strategy pipeline or hybrid, not fsdp"),
    (("--strategy", "hsdp", "--shard-size", "0"), "--shard-size 0: give a positive number of workers"),
    (("--shard-modules", "0"), "--shard-modules is for --strategy fsdp or hsdp, not ddp"),
    (("--strategy", "pipeline", "--stages", "2", "--no-reshard-after-forward"),
     "--no-reshard-after-forward is for --strategy fsdp or hsdp, not pipeline"),
])
def test_fsdp_and_hsdp_refuse_what_they_cannot_take_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 args: tuple, message: str) -> None:
    code = main_code(["train", "--model", "mlp", "--steps", "1", "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "r" / "checkpoints").exists()


ARGS = ("--quiet", "--no-tensorboard", "--strategy", "fsdp", "--devices", "1", "--optimizer", "adam", "--lr",
        "0.001", "--ema", "0.9", "--batch-size", "32", "--checkpoint-every", "5")


def test_one_fsdp_worker_resumes_exactly_and_exports_one_plain_state_dict(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main_code(["train", *ARGS, "--steps", "12", "--out", str(straight)]) == 0
    assert main_code(["train", *ARGS, "--steps", "7", "--out", str(run)]) == 0
    assert main_code(["train", "--resume", str(run), "--steps", "12", "--quiet"]) == 0
    a, b = checkpoint.load(run), checkpoint.load(straight)
    assert a["step"] == b["step"] == 12 and a["sharded"].endswith("step-00000012")
    assert max_abs_diff(a["model"], b["model"]) == 0.0 and max_abs_diff(a["ema_model"], b["ema_model"]) == 0.0
    moments = [sharded.whole(s["sharded"], ("optimizer",))["optimizer"] for s in (a, b)]
    assert len(moments[0]) > 10 and max_abs_diff(*moments) == 0.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["resumed_from_step"] == 7
    capsys.readouterr()
    assert main_code(["export", str(run), "--out", str(tmp_path / "model.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert max_abs_diff(plain, b["model"]) == 0.0
    assert main_code(["export", str(run), "--out", str(tmp_path / "ema.pt"), "--ema"]) == 0
    assert max_abs_diff(torch.load(tmp_path / "ema.pt", weights_only=True), b["ema_model"]) == 0.0
    assert main_code(["export", str(run), "--out", str(tmp_path)]) == 2
    assert "is a folder; name the file to write" in capsys.readouterr().err
    # carried on by ddp, which reads a sharded checkpoint whole: the run fsdp would have made
    assert main_code(["train", "--resume", str(run), "--steps", "14", "--strategy", "ddp", "--quiet"]) == 0
    assert main_code(["train", *ARGS, "--steps", "14", "--out", str(tmp_path / "fourteen")]) == 0
    assert max_abs_diff(checkpoint.load(run)["model"], checkpoint.load(tmp_path / "fourteen")["model"]) < 1e-6
    # and on again under fsdp: every layout writes the same step folders, which every layout reads
    assert main_code(["train", "--resume", str(run), "--steps", "16", "--strategy", "fsdp", "--quiet"]) == 0
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 14


def test_an_hsdp_run_carries_on_under_fsdp_without_its_shard_size(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main_code(["train", *ARGS[:2], "--strategy", "hsdp", "--shard-size", "1", "--devices", "1", "--steps",
                      "5", "--out", str(run)]) == 0
    assert main_code(["train", "--resume", str(run), "--strategy", "fsdp", "--steps", "8", "--quiet"]) == 0
    text = (run / "config.yaml").read_text()  # fsdp reads no shard size: its config.yaml has none
    assert "strategy: fsdp" in text and "shard_size" not in text
    whole = tmp_path / "whole"  # an earlier release's ddp run: its whole-model file is not fsdp's to read
    with earlier_release():
        assert main_code(["train", *ARGS[:2], "--devices", "1", "--steps", "5", "--out", str(whole)]) == 0
    record = (whole / "config.yaml").read_text()
    capsys.readouterr()
    assert main_code(["train", "--resume", str(whole), "--strategy", "fsdp", "--steps", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds one whole-model file of an earlier release, which --strategy fsdp does not read" in err, err
    assert (whole / "config.yaml").read_text() == record  # the run's record left as it was


def test_summary_counts_the_model_state_each_worker_holds(tmp_path: Path) -> None:
    assert main_code(["train", "--quiet", "--no-tensorboard", "--steps", "2", "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    params = sum(t.numel() for t in weights(tmp_path / "r").values()) * 4  # LeNet-5, float32
    held = summary["model_state_bytes"]
    assert len(held) == 1 and held[0]["parameters"] == held[0]["gradients"] == params
    assert params * 2 <= held[0]["optimizer"] <= params * 2 + 64 * 10  # Adam: two moments, a step count each
    assert held[0]["total"] == sum(held[0][k] for k in ("parameters", "gradients", "optimizer"))
    assert summary["peak_memory_of"] == "process rss" and len(summary["peak_memory_bytes"]) == 1
