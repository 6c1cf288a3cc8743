"""Low-rank adapters (--lora RANK, PEFT's LoRA): the adapted model starts as the model (B at zero, the base drawn
as without adapters), trains its adapters alone, and under ddp, fsdp and tp equals one device; what it cannot take is
one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import main_code, max_abs_diff, train_here, weights

pytest.importorskip("peft")

from paratrain.components.build import initial_model  # noqa: E402
from paratrain.components.inputs import load_for  # noqa: E402
from paratrain.config import TrainConfig, validate  # noqa: E402


def test_the_adapted_model_starts_as_the_model_and_trains_its_adapters_alone(examples: Path) -> None:
    cfg = validate(TrainConfig(dataset="jsonl", data_dir=str(examples), model="gpt", width=64, heads=2, context=64,
                               dropout=0.0, seed=5))
    data = load_for(cfg)
    plain, adapted = initial_model(cfg, data), initial_model(cfg.replace(lora=4, lora_dropout=0.1), data)
    x = data.train[0][:4]
    assert torch.equal(plain(x), adapted.eval()(x))  # B starts at zero; the base is drawn as without adapters
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained)
    assert all(not p.any() for n, p in adapted.named_parameters() if ".lora_B." in n)
    assert adapted.state_dict()["1.attention.query.lora_A.default.weight"].shape == (4, 64)
    head = f"{len(adapted) - 1}."  # all-linear: every linear layer but the output head
    assert not any(n.startswith(head) and ".lora_" in n for n in trained)


@pytest.mark.parametrize(("flags", "says"), [
    (["--lora", "4", "--lora-dropout", "0.1", "--strategy", "tp", "--devices", "2"],
     "--lora-dropout: under tp a rowwise layer's adapter sees its worker's part of the input"),
    (["--lora", "4", "--mesh", "pp=2", "--devices", "2"], "--lora: the adapters are trained under ddp, fsdp and tp"),
    (["--lora", "4", "--lora-targets", "nowhere"], "--lora-targets nowhere: PEFT cannot adapt them"),
    (["--lora", "4", "--lora-targets", "tokens"], "--lora adapts linear layers (nn.Linear), and '0.tokens' is a "
                                                  "NormalEmbedding"),
    (["--lora-alpha", "4"], "--lora-alpha is LoRA's: give --lora RANK too"),
    (["--lora", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), not 1.0"),
])
def test_what_lora_cannot_take_is_one_line(examples: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                           flags: list[str], says: str) -> None:
    assert main_code(["train", "--dataset", "jsonl", "--data-dir", str(examples), "--width", "64", "--heads", "2",
                      "--context", "128", "--steps", "1", "--devices", "1", "--out", str(tmp_path / "run"),
                      *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


GPT = ("--model", "gpt", "--dataset", "jsonl", "--context", "64", "--width", "64", "--depth", "2", "--heads", "2",
       "--batch-size", "16", "--optimizer", "adamw", "--lr", "1e-2", "--dropout", "0.1", "--lora", "4",
       "--lora-dropout", "0.1", "--pack", "--seed", "6", "--no-tensorboard", "--threads-per-worker", "1",
       "--checkpoint-every", "10")


@pytest.mark.integration
def test_adapters_train_on_two_workers_as_on_one_device_and_carry_on_exactly(examples: Path, tmp_path: Path) -> None:
    """Packed examples, AdamW, dropout in the model and the adapters. ddp and fsdp (the frozen weights sharded
    beside the trained ones) each end where one device does; the frozen weights end where they began. The fsdp
    run stopped at step 10 and resumed ends where it did unstopped (the windows, masks and Adam's moments carried
    over), and a run --init-from it on another seed starts from its weights, its adapters too (drawn from that
    seed, they would differ)."""
    run = (*GPT, "--data-dir", str(examples))
    one = train_here(tmp_path / "one", *run, "--devices", "1", "--steps", "20")
    cfg = validate(TrainConfig(dataset="jsonl", data_dir=str(examples), model="gpt", width=64, depth=2, heads=2,
                               context=64, dropout=0.1, lora=4, lora_dropout=0.1, pack=True, seed=6))
    began, ended = initial_model(cfg, load_for(cfg)).state_dict(), weights(tmp_path / "one")  # as every run begins
    assert all(torch.equal(began[k], ended[k]) for k in ended if ".lora_" not in k)
    assert any(not torch.equal(began[k], ended[k]) for k in ended if ".lora_" in k)
    fsdp = ("--strategy", "fsdp", "--devices", "2")
    for name, layout in {"ddp": ("--devices", "2"), "fsdp": fsdp}.items():
        other = train_here(tmp_path / name, *run, *layout, "--steps", "20")
        gaps = abs(other["test_loss"] - one["test_loss"]), max_abs_diff(ended, weights(tmp_path / name))
        assert gaps[0] <= 1e-5 and gaps[1] <= 1e-4, (name, gaps)
    train_here(tmp_path / "cut", *run, *fsdp, "--steps", "10")
    resumed = train_here(tmp_path / "cut", *run, *fsdp, "--steps", "20", "--resume", str(tmp_path / "cut"))
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 20
    assert max_abs_diff(weights(tmp_path / "fsdp"), weights(tmp_path / "cut")) == 0.0
    # one SGD step whose update rounds away (1e-30 of a gradient): the checkpoint holds what the run began from
    train_here(tmp_path / "next", *run, *fsdp, "--init-from", str(tmp_path / "fsdp"), "--steps", "1", "--optimizer",
               "sgd", "--lr", "1e-30", "--seed", "7")
    source, began = weights(tmp_path / "fsdp"), weights(tmp_path / "next")
    assert began.keys() == source.keys() and all(torch.equal(began[k], source[k]) for k in source)


@pytest.mark.integration  # (digits_run trains one)
def test_a_run_without_adapters_exports_none_in_one_line(digits_run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert main_code(["export", str(digits_run), "--format", "adapters", "--out", str(tmp_path / "ad")]) == 2
    assert "was trained without --lora: it has no adapters; export it with --format safetensors or pt" in \
        capsys.readouterr().err
    assert not (tmp_path / "ad").exists()
