"""A Hugging Face decoder cut into a pipeline by its block list (parallel/strategies/decoder.py): its pieces
compute the model's scores exactly, a stage keeps the whole model's names, a decoder that does more than its
pieces is refused; and from the command line, transformers' LlamaForCausalLM and GPT2LMHeadModel as they are under
pp=2, dp=2,pp=2 and fsdp=2,pp=2 equal one device."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import earlier_release, max_abs_diff, train_here, weights
from torch import nn

from paratrain.checkpoint import files as checkpoint
from paratrain.core.errors import UserError
from paratrain.parallel.strategies.cuts import layers_of, stage_bounds, stage_module

if importlib.util.find_spec("transformers") is None:  # imported where a test builds a decoder, not by collecting
    pytest.skip("the transformers package is not installed (pip install 'paratrain[transformers]')",
                allow_module_level=True)
HEAVY_IMPORT = "transformers"  # the fast tests of this file share one test process, which imports it (conftest.py)

FACTORIES = """
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gpt2():  # its embedding and head share one weight; dropout 0.1 (embeddings, attention, residuals)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=2,
                                      bos_token_id=0, eos_token_id=0))
"""


def _decoders() -> dict[str, nn.Module]:
    namespace: dict = {}
    exec(FACTORIES, namespace)  # noqa: S102 (the test's own factories, as the command line's file holds them)
    torch.manual_seed(3)
    return {"llama": namespace["llama"](), "gpt2": namespace["gpt2"]()}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_decoders_stages_compute_its_scores_under_its_own_names(name: str) -> None:
    """Cut after each of two places, the stages in turn give the model's scores exactly, in training mode under
    one seed too (GPT-2's dropout), and together hold each of the model's weights under its own name."""
    model = _decoders()[name]
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(5))
    layers = layers_of(model, name, torch.zeros(2, 12, dtype=torch.long))
    assert len(layers) == 5  # embeddings, 3 blocks, norm and head
    for cuts in ([1, 3], [2, 4]):
        for mode in ("eval", "train"):
            whole = copy.deepcopy(model).train(mode == "train")
            torch.manual_seed(0)
            want = whole(ids).logits
            stages = [stage_module(_pieces(model, name, mode), lo, hi) for lo, hi in stage_bounds(cuts, 5)]
            torch.manual_seed(0)
            x = ids
            for stage in stages:
                x = stage(x)
            assert torch.equal(x, want), (cuts, mode)
        names = [set(s.state_dict()) for s in stages]
        assert set().union(*names) == set(model.state_dict()) and not names[0] & names[1]
    if name == "gpt2":  # the shared weight: the first stage holds the embedding, the last the head
        assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[2]


def _pieces(model: nn.Module, name: str, mode: str) -> nn.Sequential:
    """The pieces of a copy of `model` (a stage is made of the model itself: each worker cuts its own copy)."""
    return layers_of(copy.deepcopy(model).train(mode == "train"), name, torch.zeros(2, 12, dtype=torch.long))


def test_a_decoder_that_does_more_than_its_pieces_is_refused() -> None:
    """A forward that scales the embeddings between its pieces is not the pieces in order: one line that says
    so, not a pipeline of another network."""
    model = _decoders()["llama"]
    own = model.forward
    model.forward = lambda input_ids=None, **kw: own(inputs_embeds=model.model.embed_tokens(input_ids) * 2.0, **kw)
    with pytest.raises(UserError, match="'scaled' is laid out as a Hugging Face decoder, but its embeddings, "
                                        "blocks, norm and head in order do not compute its scores"):
        layers_of(model, "scaled", torch.zeros(2, 12, dtype=torch.long))


MESHES = {"pp=2": ("--mesh", "pp=2"), "dp=2,pp=2": ("--mesh", "dp=2,pp=2", "--oversubscribe"),
          "fsdp=2,pp=2": ("--mesh", "fsdp=2,pp=2", "--oversubscribe")}


@pytest.mark.integration
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_hugging_face_decoder_from_the_command_line_under_every_pipeline_equals_one_device(
        tmp_path: Path, corpus: Path, name: str) -> None:
    """20 AdamW steps with the weight average and clipping on: the validation loss within 1e-5 of one device's
    and the weights and their average within 1e-4 (measured: 1.6e-6 for Llama, 3.5e-5 for GPT-2, its dropout on),
    GPT-2's shared embedding and head included (its gradient summed over the first and last stage, counted once
    in the norm)."""
    (tmp_path / "decoders.py").write_text(textwrap.dedent(FACTORIES))
    flags = ("--model", f"{tmp_path / 'decoders.py'}:{name}", "--dataset", "text", "--data-dir", str(corpus),
             "--context", "32", "--batch-size", "16", "--steps", "20", "--optimizer", "adamw", "--ema", "0.9",
             "--clip-grad-norm", "2", "--no-tensorboard")
    one = train_here(tmp_path / "one", *flags, "--devices", "1")
    for mesh, layout in MESHES.items():
        many = train_here(tmp_path / mesh, *flags, *layout)
        sizes = {d: int(n) for d, n in (p.split("=") for p in mesh.split(","))}
        assert many["mesh"] == {"pp": 1, "dp": 1, "fsdp": 1, "tp": 1} | sizes
        assert abs(many["val_loss"] - one["val_loss"]) <= 1e-5, (mesh, many["val_loss"], one["val_loss"])
        assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / mesh)) <= 1e-4, mesh
        averages = [checkpoint.load(run)["ema_model"] for run in (tmp_path / "one", tmp_path / mesh)]
        averages = [{k.removeprefix("module."): v for k, v in a.items() if k != "n_averaged"} for a in averages]
        assert max_abs_diff(*averages) <= 1e-4, mesh


@pytest.mark.integration
def test_a_decoder_with_a_shared_weight_carries_on_across_pipelines(tmp_path: Path, corpus: Path) -> None:
    """GPT-2 (its embedding and head one weight; AdamW with --ema) stopped at step 10 and carried on to 20 under
    another layout: pp=2's sharded checkpoint under fsdp=2,pp=2 (and on one device, until 2026-12-01: CI's 30
    minutes needed its 25 s), fsdp=2's under pp=2 (the last
    stage reads the head's state under the embedding's name, the one fsdp wrote), an earlier release's
    whole-model file of one device under fsdp=2,pp=2 (the last stage takes the head's optimizer state by the
    embedding's number). Each ends
    within 1e-4 of one device's run never stopped, the average too."""
    (tmp_path / "decoders.py").write_text(textwrap.dedent(FACTORIES))
    flags = ("--model", f"{tmp_path / 'decoders.py'}:gpt2", "--dataset", "text", "--data-dir", str(corpus),
             "--context", "32", "--batch-size", "16", "--steps", "20", "--optimizer", "adamw", "--ema", "0.9",
             "--checkpoint-every", "10", "--no-tensorboard")
    train_here(tmp_path / "whole", *flags, "--devices", "1")
    carried = {"pp": (("--mesh", "pp=2"), ("--mesh", "fsdp=2,pp=2", "--oversubscribe")),
               "fsdp": (("--strategy", "fsdp", "--devices", "2"), ("--mesh", "pp=2")),
               "one": (("--devices", "1"), ("--mesh", "fsdp=2,pp=2", "--oversubscribe"))}
    for name, (before, after) in carried.items():
        with earlier_release() if name == "one" else contextlib.nullcontext():
            train_here(tmp_path / name, *flags, *before, "--steps", "10")
        summary = train_here(tmp_path / name, "--resume", str(tmp_path / name), "--steps", "20", *after)
        assert summary["resumed_from_step"] == 10 and summary["steps"] == 20, name
        assert max_abs_diff(weights(tmp_path / "whole"), weights(tmp_path / name)) <= 1e-4, name
        averages = [checkpoint.load(run)["ema_model"] for run in (tmp_path / "whole", tmp_path / name)]
        averages = [{k.removeprefix("module."): v for k, v in a.items() if k != "n_averaged"} for a in averages]
        assert max_abs_diff(*averages) <= 1e-4, name


def test_a_shared_weight_under_tp_and_pp_together_is_one_line(tmp_path: Path, corpus: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """A Llama whose embedding and head share one weight, under --mesh tp=2,pp=2: refused before any worker
    starts (the two ends would split the weight two ways), exit 2, one line, nothing written but the refusal."""
    from conftest import main_code

    (tmp_path / "tied.py").write_text(textwrap.dedent("""
        from transformers import LlamaConfig, LlamaForCausalLM


        def llama():
            return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True))
    """))
    code = main_code(["train", "--model", f"{tmp_path / 'tied.py'}:llama", "--dataset", "text", "--data-dir",
                      str(corpus), "--context", "16", "--steps", "1", "--mesh", "tp=2,pp=2", "--oversubscribe",
                      "--quiet", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "this model's embedding and head share one weight, which tp and pp together do not split alike" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
