"""Packing (--pack): instruction examples several to a window, each at its own positions with attention kept within
it, so that a packed batch computes what its examples compute unpacked: the same scores for every example (the gpt,
and a Hugging Face model by its position_ids), the same loss at every step of a run over the same examples, on one
device and on 2 workers (fsdp, tp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import main_code, train_here

from paratrain.data import instructions
from paratrain.data.packing import bins, lengths, pack
from paratrain.data.splits import IGNORE
from paratrain.models.gpt import GPT


def _rows(sizes: list[int], counted_from: int = 2, context: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Rows of one example each (as instructions.windows gives them): `sizes` tokens, their targets counted from
    position `counted_from` on, the rest padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(sizes), context, dtype=torch.int64)
    y = torch.full((len(sizes), context), IGNORE, dtype=torch.int64)
    for i, n in enumerate(sizes):
        x[i, :n] = torch.randint(1, 256, (n,), generator=g)
        y[i, counted_from:n] = torch.randint(0, 256, (n - counted_from,), generator=g)
    return x, y


def test_every_example_is_packed_once_whole_at_its_own_positions_and_the_windows_fill_as_said() -> None:
    sizes = [10, 7, 20, 3, 12, 5, 31, 16, 16]
    x, y = _rows(sizes)
    y[1, 5:7] = IGNORE  # an example's positions after its last counted target are left out: it packs in 5
    assert lengths(y).tolist() == [10, 5, 20, 3, 12, 5, 31, 16, 16]
    columns, targets, said = pack(x, y)
    ids, positions = columns.columns["input_ids"], columns.columns["position_ids"]
    found = []
    for w in range(len(ids)):  # each window's examples, read back by where their positions start again at 0
        starts = (positions[w] == 0).nonzero().flatten().tolist() + [32]
        found += [(ids[w, a:b], targets[w, a:b]) for a, b in zip(starts, starts[1:], strict=False)
                  if bool((targets[w, a:b] != IGNORE).any())]
    expected = [(x[i, :n], y[i, :n]) for i, n in enumerate(lengths(y).tolist())]
    assert sorted((a.tolist(), b.tolist()) for a, b in found) == sorted((a.tolist(), b.tolist()) for a, b in expected)
    # 118 positions: 4 windows at the least (31 | 20 12 | 16 16 | 10 5 5 3), which best fit finds
    assert len(ids) == 4 and said == {"examples": 9, "windows": 4, "fill": round(118 / 128, 4)}
    assert all(sum(sizes_in) <= 32 for sizes_in in ([lengths(y)[r] for r in rows] for rows in bins(
        lengths(y).tolist(), 32)))


def _scores_kept_apart(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """How far each example's scores packed are from its scores alone, at every position it keeps: with its
    positions and attention kept apart, and (to show the check can fail) packed as one text, each window's
    examples seeing those before them."""
    columns, _, _ = pack(x, y)
    sizes = lengths(y).tolist()
    with torch.no_grad():
        alone, packed, as_text = model(x), model(columns[:]), model(columns.columns["input_ids"])
    gaps, text_gaps = [0.0], [0.0]
    for w, rows in enumerate(bins(sizes, x.shape[1])):  # the windows as pack fills them
        at = 0
        for r in rows:
            n = sizes[r]
            gaps.append(float((packed[w, at:at + n] - alone[r, :n]).abs().max()))
            text_gaps.append(float((as_text[w, at:at + n] - alone[r, :n]).abs().max()))
            at += n
    return max(gaps), max(text_gaps)


def test_the_gpt_keeps_packed_examples_apart() -> None:
    torch.manual_seed(3)
    x, y = _rows([10, 7, 20, 3, 12, 5, 31, 16, 16], seed=1)
    gap, as_text = _scores_kept_apart(GPT(256, 32, 64, 2, 4).eval(), x, y)
    assert gap <= 1e-5 and as_text > 1e-2, (gap, as_text)


def test_a_hugging_face_model_keeps_packed_examples_apart_by_their_position_ids() -> None:
    """transformers finds packed examples from position_ids only without a key/value cache, which the batch's
    keywords turn off (components/adapt.py): with the cache on, the examples would see each other."""
    transformers = pytest.importorskip("transformers")
    from paratrain.components.adapt import read_by_logits

    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    llama = read_by_logits(transformers.LlamaForCausalLM(config).eval())
    x, y = _rows([10, 7, 20, 3, 12, 5, 31, 16, 16], seed=2)
    gap, _ = _scores_kept_apart(llama, x, y)
    assert gap <= 1e-5, gap
    llama._paratrain_takes_cache = False  # the cache left on: the examples see each other
    cached, _ = _scores_kept_apart(llama, x, y)
    assert cached > 1e-2, cached


def _steps(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


GPT_RUN = ("--model", "gpt", "--dataset", "jsonl", "--context", "128", "--width", "64", "--depth", "2", "--heads",
           "2", "--optimizer", "adamw", "--lr", "1e-3", "--seed", "8", "--no-tensorboard", "--threads-per-worker", "1",
           "--log-every", "1", "--val-size", "8", "--test-size", "8")


def test_packed_and_unpacked_runs_of_the_same_examples_give_the_same_loss_at_every_step(
        examples: Path, tmp_path: Path) -> None:
    """Every training example in each step (the whole split a batch), packed or one a window: the same loss at
    every step, the same validation and test losses; the summary says how full the packed windows were."""
    data = instructions.load(str(examples), 128, "bytes", 8, 8)
    windows = instructions.load(str(examples), 128, "bytes", 8, 8, pack=True)
    n, packed_n = len(data.train[1]), len(windows.train[1])
    assert packed_n < 0.7 * n
    one = train_here(tmp_path / "one", *GPT_RUN, "--data-dir", str(examples), "--batch-size", str(n), "--steps", "6",
                     "--devices", "1")
    two = train_here(tmp_path / "packed", *GPT_RUN, "--data-dir", str(examples), "--batch-size", str(packed_n),
                     "--steps", "6", "--pack", "--devices", "1")
    losses, packed = _steps(tmp_path / "one"), _steps(tmp_path / "packed")
    assert len(losses) == len(packed) == 6 and losses[-1] < losses[0] - 0.1
    assert max(abs(a - b) for a, b in zip(losses, packed, strict=True)) <= 1e-5, (losses, packed)
    assert abs(one["test_loss"] - two["test_loss"]) <= 1e-5 and abs(one["val_loss"] - two["val_loss"]) <= 1e-5
    assert two["packed_examples"] == n and two["packed_windows"] == packed_n and 0.5 < two["packed_fill"] <= 1
    assert "packed_fill" not in one


@pytest.mark.parametrize(("flags", "says"), [
    (["--dataset", "text", "--pack"], "--pack packs --dataset jsonl's examples into windows, not text's (text is"),
    (["--model", "mlp", "--pack"], "--pack keeps packed examples apart by their position_ids, which the gpt and"),
    (["--pack", "--mesh", "pp=2", "--devices", "2"], "these inputs are named columns (a dict, as --pack makes them): "
                                                    "use ddp, fsdp or tp"),
])
def test_what_packing_cannot_take_is_one_line(examples: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                              flags: list[str], says: str) -> None:
    base = ["train", "--dataset", "jsonl", "--data-dir", str(examples), "--width", "64", "--context", "128", "--steps",
            "1", "--out", str(tmp_path / "run")]
    assert main_code([*base, *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.integration
def test_packed_examples_train_on_two_workers_as_on_one_device(examples: Path, tmp_path: Path) -> None:
    """fsdp and tp over packed windows, dropout on: each ends where one device does."""
    from conftest import max_abs_diff, weights

    run = (*GPT_RUN, "--data-dir", str(examples), "--batch-size", "8", "--steps", "12", "--dropout", "0.1", "--pack")
    one = train_here(tmp_path / "one", *run, "--devices", "1")
    for name, layout in {"fsdp": ("--strategy", "fsdp", "--devices", "2"), "tp": ("--mesh", "tp=2")}.items():
        other = train_here(tmp_path / name, *run, *layout)
        gaps = abs(other["test_loss"] - one["test_loss"]), max_abs_diff(weights(tmp_path / "one"),
                                                                          weights(tmp_path / name))
        print(name, gaps)
        assert gaps[0] <= 1e-5 and gaps[1] <= 1e-4, (name, gaps)


def test_a_hugging_face_model_whose_attention_ignores_the_packing_is_one_line() -> None:
    """Flash attention keeps packed examples apart only in a batch of one row: refused before any step."""
    from types import SimpleNamespace

    from paratrain.core.errors import UserError
    from paratrain.models.hf import check_packable

    pytest.importorskip("transformers")
    check_packable(SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")), "hf:m")
    with pytest.raises(UserError, match="runs flash_attention_2 attention, which keeps packed examples apart only"):
        check_packable(SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2")), "hf:m")
