"""Activation checkpointing (features/recompute.py): the blocks found in the gpt, a Hugging Face model and a
ResNet, the modules each mode recomputes, the parameters' names unchanged, gradients equal to the bit with
dropout drawn as one device draws it (placed and unplaced masks), bad options in one line; on CPU workers, every
strategy with --activation-checkpointing full equals one device without it, and the gpt of the issue holds at
most 0.7x the memory."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import main_code, max_abs_diff, run_cli, train_here, weights
from torch import nn

from paratrain.core.errors import UserError
from paratrain.features import recompute
from paratrain.features.dropout import GlobalBatchDropout
from paratrain.models.gpt import GPT


def _gpt(dropout: float = 0.1, depth: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(64, 16, 32, depth, 2, dropout=dropout)


def test_the_blocks_are_the_networks_repeated_layers() -> None:
    from torchvision.models import resnet18
    from transformers import LlamaConfig, LlamaForCausalLM

    gpt = _gpt()
    assert recompute.blocks(gpt) == list(gpt)[1:5]
    one = _gpt(depth=1)  # one block is still the gpt's block (not its embedding, also a module with layers)
    assert recompute.blocks(one) == [one[1]]
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert recompute.blocks(llama) == list(llama.model.layers)
    resnet = resnet18()
    assert [type(b).__name__ for b in recompute.blocks(resnet)] == ["BasicBlock"] * 8
    with pytest.raises(UserError, match="--activation-checkpointing full: Sequential has no repeated blocks"):
        recompute.chosen(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "full", "2")
    with pytest.raises(UserError, match="have no child named attention or attn; give --selective-ac K"):
        recompute.chosen(resnet, "selective", "attention")


def test_each_mode_chooses_its_modules_and_the_names_stay() -> None:
    gpt = _gpt()
    layers = list(gpt)[1:5]
    assert recompute.chosen(gpt, "none", "2") == []
    assert recompute.chosen(gpt, "full", "2") == layers
    assert recompute.chosen(gpt, "selective", "2") == [layers[0], layers[2]]
    assert recompute.chosen(gpt, "selective", "3") == [layers[0], layers[3]]
    assert recompute.chosen(gpt, "selective", "attention") == [b.attention for b in layers]
    before = [name for name, _ in gpt.named_parameters()]
    assert recompute.apply(gpt, "full", "2") == 4
    assert [name for name, _ in gpt.named_parameters()] == before and list(gpt.state_dict()) == before
    assert type(gpt[1]).__name__ == "RecomputedBlock" and isinstance(gpt[1], type(_gpt()[1]))
    copy.deepcopy(gpt)  # an EMA's copy


def _gradients(model: nn.Module, x: torch.Tensor, rows: int, share: tuple[int, int] = (0, 1)) -> list[torch.Tensor]:
    model.zero_grad()
    with GlobalBatchDropout(torch.device("cpu"), share, rows, 123, 0):
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("mode", "option"), [("full", "2"), ("selective", "2"), ("selective", "attention")])
@pytest.mark.parametrize("placed", [True, False])
def test_recomputed_gradients_equal_kept_ones_to_the_bit_with_dropout(mode: str, option: str, placed: bool) -> None:
    """Dropout 0.1 drawn by paratrain's masks: placed in the global batch (seeded by the call's place), or not
    (rows that are not the worker's: drawn from a stream), each replayed by the recomputation."""
    kept, recomputed = _gpt(), _gpt()
    recompute.apply(recomputed, mode, option)
    x = torch.randint(0, 64, (4, 16))
    rows = 4 if placed else 3  # 4 rows are not a whole number of 3: every mask is unplaced
    want, got = _gradients(kept, x, rows), _gradients(recomputed, x, rows)
    assert max((a - b).abs().max().item() for a, b in zip(want, got, strict=True)) == 0.0
    without = _gradients(_gpt(dropout=0.0), x, rows)  # the masks dropped something
    assert max((a - b).abs().max().item() for a, b in zip(want, without, strict=True)) > 1e-4


def test_a_pipeline_stage_that_places_other_chunks_between_replays_its_own() -> None:
    """Between a chunk's forward and its backward a stage places other chunks: the recomputation draws the
    masks of the chunk's own rows."""
    model = _gpt()
    twin = copy.deepcopy(model)
    recompute.apply(twin, "full", "2")
    x = torch.randint(0, 64, (4, 16))
    grads = []
    for net in (model, twin):
        net.zero_grad()
        with GlobalBatchDropout(torch.device("cpu"), (0, 2), 2, 7, 0) as mode:
            mode.place(0, 2, 0)
            first = net(x[:2])
            mode.place(1, 2, 0)
            second = net(x[2:])
            (first.square().mean() + second.square().mean()).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*grads, strict=True)) == 0.0


@pytest.mark.parametrize(("flags", "message"), [
    (["--activation-checkpointing", "half"], "--activation-checkpointing: invalid choice: 'half'"),
    (["--selective-ac", "2"], "--selective-ac is not read by --activation-checkpointing none"),
    (["--activation-checkpointing", "selective", "--selective-ac", "0"], "--selective-ac must be a positive whole"),
    (["--activation-checkpointing", "full", "--compile"], "--compile with --activation-checkpointing is not"),
    (["--activation-checkpointing", "full", "--model", "mlp", "--steps", "1"],
     "MLP has no repeated blocks to recompute")])
def test_what_cannot_be_recomputed_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                               message: str) -> None:
    code = main_code(["train", "--quiet", "--out", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err, err


def test_one_device_recomputing_ends_with_the_weights_of_the_run_keeping(tmp_path: Path, corpus: Path) -> None:
    flags = ("--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--width", "32", "--depth", "2",
             "--heads", "2", "--context", "16", "--batch-size", "8", "--steps", "4", "--optimizer", "adamw",
             "--dropout", "0.1", "--no-tensorboard")
    train_here(tmp_path / "kept", *flags)
    train_here(tmp_path / "recomputed", *flags, "--activation-checkpointing", "selective", "--selective-ac", "1")
    assert max_abs_diff(weights(tmp_path / "kept"), weights(tmp_path / "recomputed")) == 0.0


# ---- on CPU workers ----

LAYOUTS = {"ddp": ("--strategy", "ddp", "--devices", "2"), "fsdp": ("--strategy", "fsdp", "--devices", "2"),
           "tp": ("--strategy", "tp", "--devices", "2"),
           "pipeline": ("--strategy", "pipeline", "--stages", "2", "--devices", "2")}


@pytest.mark.integration
@pytest.mark.matrix(
    ("ddp", "activation checkpointing", "1.2e-6"),
    ("fsdp", "activation checkpointing", "1.2e-6"),
    ("tp", "activation checkpointing", "3.4e-6"),
    ("pipeline", "activation checkpointing", "8.3e-7"))
def test_every_strategy_recomputing_equals_one_device_keeping(tmp_path: Path, corpus: Path) -> None:
    """20 AdamW steps of the gpt with dropout 0.1: 1 device without recomputation against each strategy on 2
    workers with --activation-checkpointing full, within 1e-4 (the layouts' own gap to one device, measured at
    most 1.6e-5 in test_tensor_parallel; recomputation adds none)."""
    flags = ("--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--optimizer", "adamw", "--width",
             "64", "--depth", "2", "--heads", "4", "--context", "64", "--batch-size", "16", "--steps", "20",
             "--dropout", "0.1", "--no-tensorboard")
    one = train_here(tmp_path / "one", *flags, "--devices", "1")
    for name, layout in LAYOUTS.items():
        many = train_here(tmp_path / name, *flags, *layout, "--activation-checkpointing", "full")
        assert many["world_size"] == 2
        assert abs(many["val_loss"] - one["val_loss"]) <= 1e-5, name
        assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / name)) <= 1e-4, name


@pytest.mark.integration
def test_the_gpt_whose_activations_dominate_holds_at_most_0_7x_the_memory(tmp_path: Path, corpus: Path) -> None:
    """Depth 4, width 256, context 256, batch 32, one worker of one thread, each run its own process: the same
    weights and at most 0.7x the peak resident memory (measured 0.62x; what the steps added to the memory at
    their start: 0.31x)."""
    flags = ["train", "--quiet", "--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--width", "256",
             "--depth", "4", "--context", "256", "--batch-size", "32", "--steps", "3", "--optimizer", "adamw",
             "--devices", "1", "--threads-per-worker", "1", "--no-tensorboard"]
    runs = {}
    for mode in ("none", "full"):
        done = run_cli(*flags, "--out", str(tmp_path / mode), "--activation-checkpointing", mode, timeout=600)
        assert done.returncode == 0, done.stderr
        runs[mode] = json.loads((tmp_path / mode / "summary.json").read_text())
    assert max_abs_diff(weights(tmp_path / "none"), weights(tmp_path / "full")) <= 1e-6
    peak = {mode: s["peak_memory_bytes"][0] for mode, s in runs.items()}
    added = {mode: s["peak_memory_added_bytes"][0] for mode, s in runs.items()}
    assert peak["full"] <= 0.7 * peak["none"], peak
    assert added["full"] <= 0.5 * added["none"], added


def test_the_blocks_are_run_again_in_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.models import gpt as gpt_module

    calls = []
    forward = gpt_module.MLP.forward
    monkeypatch.setattr(gpt_module.MLP, "forward", lambda self, x: calls.append(1) or forward(self, x))
    for mode, runs in (("none", 4), ("full", 8), ("selective", 6)):  # selective 2: blocks 0 and 2 again
        calls.clear()
        model = _gpt()
        recompute.apply(model, mode, "2")
        _gradients(model, torch.randint(0, 64, (4, 16)), 4)
        assert len(calls) == runs, mode


def test_batchnorm_statistics_count_each_batch_once() -> None:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
                               for _ in range(3)))

    kept, recomputed = net(), net()
    assert recompute.apply(recomputed, "full", "2") == 3
    x = torch.randn(4, 3, 8, 8)
    for model in (kept, recomputed):
        model(x).square().mean().backward()
    assert max_abs_diff(kept.state_dict(), recomputed.state_dict()) == 0.0  # running means, variances, counts
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(kept.parameters(), recomputed.parameters(), strict=True))


def test_a_hugging_face_decoder_recomputed_equals_it_kept() -> None:
    """transformers' Llama as it is: its decoder layers recomputed (its key/value cache turned off, which a
    recomputed layer would fill twice) give the gradients of the layers kept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))

    kept, recomputed = llama(), llama()
    assert recompute.apply(recomputed, "full", "2") == 2 and recomputed.config.use_cache is False
    ids = torch.randint(0, 64, (2, 12))
    for model in (kept, recomputed):
        model(input_ids=ids, labels=ids).loss.backward()
    assert max((a.grad - b.grad).abs().max().item()
               for a, b in zip(kept.parameters(), recomputed.parameters(), strict=True)) <= 1e-6


def test_the_tower_refuses_it_in_one_line() -> None:
    from paratrain.config import TrainConfig
    from paratrain.parallel.strategies.tower import TowerStrategy

    with pytest.raises(UserError, match="--activation-checkpointing is not available with --strategy tower"):
        TowerStrategy.check(TrainConfig(strategy="tower", activation_checkpointing="full"))
