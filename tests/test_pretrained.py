"""A run started from pretrained weights (--init-from) of a transformers model named by its folder (--model
hf:PATH): a small LlamaForCausalLM saved with save_pretrained (random weights) is fine-tuned on prompts and responses
(--dataset jsonl, the prompts' tokens not counted) on 1 device, fsdp=2 and tp=2, each worker reading only its part
of the folder's safetensors: its first weights are the saved ones to the bit, and after 20 AdamW steps the layouts
equal one device. Every bad source is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import main_code, max_abs_diff, train_here, weights

transformers = pytest.importorskip("transformers")

LAYOUTS = {"1 device": ("--devices", "1"), "fsdp": ("--strategy", "fsdp", "--devices", "2"),
           "tp": ("--mesh", "tp=2")}


def _llama(folder: Path, hidden: int = 64, seed: int = 11) -> Path:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama") / "model")


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _base(llama: Path, examples: Path) -> tuple[str, ...]:
    """Fine-tuning on prompts and responses, the prompts' tokens not counted (--dataset jsonl)."""
    return ("--model", f"hf:{llama}", "--init-from", str(llama), "--dataset", "jsonl", "--data-dir", str(examples),
            "--context", "64", "--batch-size", "8", "--no-tensorboard", "--threads-per-worker", "1")


ADAMW = ("--steps", "20", "--optimizer", "adamw", "--lr", "1e-3", "--seed", "4")


def _starts_from_the_saved_weights(llama: Path, examples: Path, run: Path, layout: str) -> None:
    # one SGD step at a rate whose step rounds away (1e-30 of a gradient, against weights of 1e-2 and more): the
    # checkpoint holds the weights the run started from
    train_here(run, *_base(llama, examples), *LAYOUTS[layout], "--steps", "1", "--optimizer", "sgd", "--lr", "1e-30")
    saved, started = _saved(llama), weights(run)
    assert all(torch.equal(started[k], saved[k]) for k in saved), layout


@pytest.fixture(scope="module")
def one_device(llama: Path, examples: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The fine-tuning on one device (which starts from the saved weights too), run once for the module."""
    root = tmp_path_factory.mktemp("one")
    _starts_from_the_saved_weights(llama, examples, root / "start", "1 device")
    return root / "run", train_here(root / "run", *_base(llama, examples), *LAYOUTS["1 device"], *ADAMW)


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_every_worker_starts_from_the_saved_weights_and_fine_tunes_as_one_device(
        llama: Path, examples: Path, one_device: tuple[Path, dict], tmp_path: Path, layout: str) -> None:
    _starts_from_the_saved_weights(llama, examples, tmp_path / "start", layout)
    summary = train_here(tmp_path / "tuned", *_base(llama, examples), *LAYOUTS[layout], *ADAMW)
    one, reference = one_device
    assert abs(summary["test_loss"] - reference["test_loss"]) <= 1e-5
    # measured on the 2-core build machine: fsdp 1.4e-6, tp 5.5e-5 (Adam carries tp's other sums of the same
    # products on at full size: docs/explanations/equal-to-one-device.md)
    assert max_abs_diff(weights(one), weights(tmp_path / "tuned")) <= 2e-4
    if layout == "fsdp":  # (a sharded checkpoint, exported a tensor at a time)
        _exported_as_run(tmp_path / "tuned", tmp_path / "export")


@pytest.mark.integration
def test_adapters_of_a_pretrained_model_train_under_fsdp_and_tp_as_on_one_device_and_export_as_peft_loads_them(
        llama: Path, examples: Path, tmp_path: Path) -> None:
    """--lora 8 on the Llama read from its folder: one device, fsdp=2 and tp=2 (each adapter split with its layer,
    tensor_plan.py) end alike, the folder's weights untouched (frozen); the adapters exported load in PEFT beside
    the folder's model, and the merged model in transformers, each giving paratrain's logits (the merged to
    rounding: W + B A x scale, summed once)."""
    peft = pytest.importorskip("peft")
    import paratrain

    lora = (*_base(llama, examples), *ADAMW, "--lr", "1e-2", "--lora", "8")
    one = train_here(tmp_path / "one", *lora, *LAYOUTS["1 device"])
    for layout in ("fsdp", "tp"):  # measured in the weights on the 2-core build machine: fsdp 7.3e-7, tp 1.4e-6
        other = train_here(tmp_path / layout, *lora, *LAYOUTS[layout])
        gaps = abs(one["test_loss"] - other["test_loss"]), max_abs_diff(weights(tmp_path / "one"),
                                                                          weights(tmp_path / layout))
        assert gaps[0] <= 1e-5 and gaps[1] <= 1e-5, (layout, gaps)
    saved = _saved(llama)
    kept = {k.replace(".base_layer.", "."): t for k, t in weights(tmp_path / "fsdp").items() if ".lora_" not in k}
    assert kept.keys() == saved.keys() and all(torch.equal(kept[k], saved[k]) for k in saved)
    assert main_code(["export", str(tmp_path / "fsdp"), "--format", "adapters", "--out", str(tmp_path / "ad")]) == 0
    assert main_code(["export", str(tmp_path / "fsdp"), "--format", "safetensors", "--out",
                      str(tmp_path / "merged")]) == 0
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = paratrain.load_model(tmp_path / "fsdp")(x)
        base = transformers.AutoModelForCausalLM.from_pretrained(llama)
        assert (base(x).logits - ours).abs().max() > 1e-3  # (the adapters moved it: the checks below can fail)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
        assert torch.equal(adapted(x).logits, ours)
        # tp's adapters, split with their layers, exported whole (a DTensor's shards gathered)
        assert main_code(["export", str(tmp_path / "tp"), "--format", "adapters", "--out",
                          str(tmp_path / "tp-ad")]) == 0
        split = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama),
                                               tmp_path / "tp-ad").eval()
        assert torch.equal(split(x).logits, paratrain.load_model(tmp_path / "tp")(x))
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert torch.allclose(merged(x).logits, ours, atol=1e-5)


def _exported_as_run(run: Path, out: Path) -> None:
    """The run's safetensors export, loaded by transformers, gives the logits of the run as paratrain loads it."""
    import paratrain

    assert main_code(["export", str(run), "--format", "safetensors", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(x).logits, paratrain.load_model(run)(x))


@pytest.mark.integration
def test_the_gpts_safetensors_export_starts_a_run_with_its_weights(corpus: Path, tmp_path: Path) -> None:
    gpt = ("--model", "gpt", "--dataset", "text", "--data-dir", str(corpus), "--width", "32", "--heads", "2",
           "--depth", "2", "--context", "16", "--batch-size", "8", "--no-tensorboard")
    train_here(tmp_path / "run", *gpt, "--strategy", "fsdp", "--devices", "2", "--steps", "3", "--ema", "0.9")
    assert main_code(["export", str(tmp_path / "run"), "--format", "safetensors", "--ema", "--out",
                      str(tmp_path / "out")]) == 0
    train_here(tmp_path / "again", *gpt, "--init-from", str(tmp_path / "out"), "--steps", "1", "--optimizer", "sgd",
               "--lr", "1e-30")
    from safetensors.torch import load_file

    exported, started = load_file(str(tmp_path / "out" / "model.safetensors")), weights(tmp_path / "again")
    average = _ema(tmp_path / "run")
    assert exported.keys() == started.keys() == average.keys()
    assert all(torch.equal(exported[k], started[k]) and torch.equal(exported[k], average[k]) for k in exported)


def _ema(run: Path) -> dict[str, torch.Tensor]:
    from paratrain.checkpoint import files as checkpoint

    return checkpoint.load(run)["ema_model"]


def _error(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main_code(["train", "--quiet", "--steps", "1", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paratrain: error: "), lines
    return lines[0]


def test_each_bad_source_of_weights_is_one_line(llama: Path, corpus: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    data = ("--dataset", "text", "--data-dir", str(corpus), "--context", "32", "--out", str(tmp_path / "run"))
    empty, quantized = tmp_path / "empty", tmp_path / "int8"
    for folder in (empty, quantized):
        folder.mkdir()
        (folder / "config.json").write_text((llama / "config.json").read_text())
    from safetensors.torch import save_file

    save_file({k: v.to(torch.int8) for k, v in _saved(llama).items()}, str(quantized / "model.safetensors"))
    wider, gpt2 = _llama(tmp_path / "wider", hidden=128), tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64,
                                                         vocab_size=256)).save_pretrained(gpt2)
    capsys.readouterr()  # (save_pretrained's progress bars)
    model = ("--model", f"hf:{llama}")
    assert "holds no config.json" in _error(capsys, "--model", f"hf:{tmp_path}", *data)
    assert "no .safetensors files" in _error(capsys, *model, "--init-from", str(empty), *data)
    assert "shapes differ" in _error(capsys, *model, "--init-from", str(wider), *data)
    assert "another model's weights" in _error(capsys, *model, "--init-from", str(gpt2), *data)
    assert "cannot train" in _error(capsys, *model, "--init-from", str(quantized), *data)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(f"model: hf:{llama}\ndataset: text\ndata_dir: {corpus}\n")
    assert "drop one of them" in _error(capsys, *model, "--init-from", str(llama), "--resume", str(tmp_path / "run"),
                                        *data)
    assert "no such file" in _error(capsys, *model, "--init-from", str(tmp_path / "nowhere"), *data)
    for name, cut in (("header", 40), ("tensors", -100)):  # a copy cut short: in its header, or in its tensors
        damaged = tmp_path / f"damaged-{name}"
        damaged.mkdir()
        (damaged / "config.json").write_text((llama / "config.json").read_text())
        (damaged / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes()[:cut])
        said = _error(capsys, *model, "--init-from", str(damaged), *data)
        assert "model.safetensors" in said and ("damaged" in said or "cut short" in said), said


def test_each_bad_export_folder_is_one_line(llama: Path, examples: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    run = tmp_path / "run"
    with capsys.disabled():  # (train_here's hang guard writes to the real stderr)
        train_here(run, *_base(folder, examples), "--devices", "1", "--steps", "1")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("mine")
    capsys.readouterr()
    for out, said in ((tmp_path / "full", "is not an empty folder"), (tmp_path / "model.pt", "writes a folder")):
        assert main_code(["export", str(run), "--format", "safetensors", "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], lines
    assert (tmp_path / "full" / "kept.txt").read_text() == "mine"  # nothing of the user's touched
    shutil.rmtree(folder)  # the run's model folder gone: one line, and no half-written folder left
    assert main_code(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is gone" in lines[0] and not (tmp_path / "out").exists(), lines
