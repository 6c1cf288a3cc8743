"""Instruction and chat examples (--dataset jsonl): each example one window whose targets count its answer alone
(the prompt's and the padding's are -100), the loss a mean over the answers' tokens; chats through a tokenizer's
chat template or as plain lines; and each bad file one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import main_code, write_examples

from paratrain.core.errors import UserError
from paratrain.data import instructions
from paratrain.data.splits import IGNORE
from paratrain.data.tokenizers import tokenizer_for
from paratrain.optimization.losses import cross_entropy


def _lines(path: Path, *examples: dict) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def test_the_prompts_targets_count_nothing_and_the_answers_each_token(tmp_path: Path) -> None:
    pairs = [("What is 2+2? ", "4."), ("Name a colour: ", "green"), ("Say hi ", "hi"), ("Long " * 9, "cut off here")]
    path = _lines(tmp_path / "p.jsonl", *({"prompt": p, "response": r} for p, r in pairs))
    x, y, cut = instructions.windows([instructions.pieces_of(json.loads(line), tokenizer_for("bytes"), "")
                                      for line in path.read_text().splitlines()], 24)
    assert cut == 1  # the last: 45 + 12 bytes in a window of 24 + 1
    for i, (prompt, response) in enumerate(pairs):
        ids = list((prompt + response).encode())[:25]
        assert x[i, :len(ids) - 1].tolist() == ids[:-1] and not x[i, len(ids) - 1:].any()  # padded with 0
        # position t predicts token t + 1: counted where that token is the response's
        counted = [t for t in range(len(ids) - 1) if t + 1 >= len(prompt.encode())]
        assert (y[i] != IGNORE).nonzero().flatten().tolist() == counted
        assert y[i, counted].tolist() == ids[len(prompt.encode()):]


def test_the_loss_is_the_mean_over_the_answers_tokens_alone(tmp_path: Path) -> None:
    """The cross-entropy a run trains on, from the loader's windows, equals the mean of -log p over the response
    tokens taken from the examples themselves; giving the prompt's positions targets would change it."""
    splits = instructions.load(str(write_examples(tmp_path / "e.jsonl", 40)), 128, "bytes", 4, 4)
    x, y = splits.train
    torch.manual_seed(0)
    logits = torch.randn(*x.shape, 256)
    lines = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    by_input = {tuple(x[i].tolist()): i for i in range(len(x))}
    losses = []
    for e in lines:
        ids = list((e["prompt"] + e["response"]).encode())[:129]
        row = by_input.get(tuple(ids[:-1] + [0] * (129 - len(ids))))
        if row is None:  # held out
            continue
        for t in range(len(e["prompt"].encode()) - 1, len(ids) - 1):
            losses.append(-F.log_softmax(logits[row, t], -1)[ids[t + 1]])
    assert len(losses) == int((y != IGNORE).sum())
    assert torch.allclose(cross_entropy(logits, y), torch.stack(losses).mean())
    other = logits.clone()  # other scores wherever the target is not counted (the prompts, the padding): no change
    other[y == IGNORE] = torch.randn(int((y == IGNORE).sum()), 256)
    assert torch.equal(cross_entropy(other, y), cross_entropy(logits, y))
    prompts = y.clone()
    prompts[(y == IGNORE) & (x != 0)] = 7  # the prompt's positions given a target: the test could fail
    assert not torch.allclose(cross_entropy(logits, prompts), torch.stack(losses).mean())


def test_examples_cut_or_left_out_are_said_in_one_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _lines(tmp_path / "e.jsonl", *[{"prompt": "p" * 10, "response": "r" * 10}] * 4,
                  {"prompt": "p" * 30, "response": "r"}, {"prompt": "short", "response": "r"})
    splits = instructions.load(str(path), 16, "bytes", 1, 1)
    assert sum(len(getattr(splits, s)[0]) for s in ("train", "val", "test")) == 5
    assert capsys.readouterr().err == ("paratrain: warning: e.jsonl: of its 6 examples 5 are cut at the end of a "
                                       "window of --context 16 and 1 left out (their prompts fill it); a longer "
                                       "--context keeps them\n")
    instructions.load(str(path), 64, "bytes", 1, 1)
    assert capsys.readouterr().err == ""  # nothing cut, nothing said


def test_a_chat_without_a_template_is_lines_of_role_and_content_its_assistant_turns_counted(tmp_path: Path) -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
                         {"role": "assistant", "content": "Bye."}]}
    pieces = instructions.pieces_of(chat, tokenizer_for("bytes"), "")
    text = "".join(bytes(p).decode() for p, _ in pieces)
    assert text == "system: Be brief.\nuser: Hi?\nassistant: Hello.\nuser: Bye?\nassistant: Bye.\n"
    assert [bytes(p).decode() for p, counted in pieces if counted] == ["Hello.\n", "Bye.\n"]


def test_a_chat_through_a_tokenizers_template_counts_what_the_template_gives_each_assistant_turn() -> None:
    """A template of our own (the tokenizer a model folder brings): each turn rendered as the template renders
    the chat up to it, the assistant's header not counted, its answer and end marker counted."""

    def chat(messages: list[dict], generation: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<assistant>" if generation else "")

    tok = tokenizer_for("bytes")
    templated = type(tok)(tok.name, tok.vocabulary, tok.encode, tok.decode, chat=chat)
    pieces = instructions.pieces_of({"messages": [{"role": "user", "content": "Hi?"},
                                                  {"role": "assistant", "content": "Hello."}]}, templated, "")
    assert [(bytes(p).decode(), c) for p, c in pieces] == [("<user>Hi?</s>", False), ("<assistant>", False),
                                                          ("Hello.</s>", True)]


@pytest.mark.parametrize(("lines", "says"), [
    (['{"prompt": "a"}'], r"needs \"prompt\" and \"response\" strings"),
    (["not json"], r"e.jsonl:1 is not JSON"),
    (["[1, 2]"], r"e.jsonl:1 is a JSON list, not an object"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], r"has no \"assistant\" turn"),
    (['{"messages": "hi"}'], r"must be a list of"),
    (['{"prompt": "' + "p" * 40 + '", "response": "r"}'] * 3 + ['{"prompt": "a", "response": "b"}'],
     r"1 of its 4 examples leave an answer token in a window of --context 16"),
    (['{"prompt": "a", "response": "b"}'], r"holds 1 example\(s\); give at least 3"),
])
def test_each_bad_file_of_examples_is_one_line(tmp_path: Path, lines: list[str], says: str) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=says):
        instructions.load(str(path), 16, "bytes", 1, 1)


def test_the_command_line_trains_on_examples_and_says_what_a_missing_file_needs(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_code(["train", "--dataset", "jsonl", "--data-dir", str(tmp_path / "none.jsonl"),
                      "--out", str(tmp_path / "run")]) == 2
    assert "no such file; give a file of JSON lines" in capsys.readouterr().err
    assert main_code(["train", "--dataset", "jsonl", "--out", str(tmp_path / "run")]) == 2
    assert "--dataset jsonl needs --data-dir FILE.jsonl" in capsys.readouterr().err


GPT = ("--model", "gpt", "--dataset", "jsonl", "--context", "64", "--width", "64", "--depth", "2", "--heads", "2",
       "--batch-size", "16", "--optimizer", "adamw", "--lr", "1e-3", "--steps", "20", "--dropout", "0.1", "--seed",
       "3", "--no-tensorboard", "--threads-per-worker", "1")


@pytest.mark.integration
def test_two_workers_train_on_examples_as_one_device(examples: Path, tmp_path: Path) -> None:
    """Each worker's share of a step counts other answer tokens: the loss is the step's mean over all of them
    (losses.token_weights), so 2 workers (ddp, and fsdp) end where one device does, dropout on."""
    from conftest import max_abs_diff, train_here, weights

    one = train_here(tmp_path / "one", *GPT, "--data-dir", str(examples), "--devices", "1")
    for name, layout in {"ddp": ("--devices", "2"), "fsdp": ("--strategy", "fsdp", "--devices", "2")}.items():
        other = train_here(tmp_path / name, *GPT, "--data-dir", str(examples), *layout)
        gaps = abs(other["test_loss"] - one["test_loss"]), max_abs_diff(weights(tmp_path / "one"),
                                                                          weights(tmp_path / name))
        print(name, gaps)
        assert gaps[0] <= 1e-5 and gaps[1] <= 1e-4, (name, gaps)


def _tokenizer_folder(folder: Path) -> Path:
    """A model folder's tokenizer as save_pretrained writes it: a byte-level BPE of 300 tokens learnt from the
    corpus, an end token, and a chat template of its own."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([line for line in (Path(__file__).parent / "test_instructions.py").read_text()
                             .splitlines()], vocab_size=300, special_tokens=["</s>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(folder)
    return folder


def test_a_model_folder_brings_its_tokenizer_its_end_token_and_its_chat_template(tmp_path: Path) -> None:
    from paratrain.config import TrainConfig, validate

    folder = _tokenizer_folder(tmp_path / "model")
    (folder / "config.json").write_text("{}")
    cfg = validate(TrainConfig(model=f"hf:{folder}", dataset="jsonl", data_dir=str(tmp_path / "e.jsonl")))
    assert cfg.tokenizer == str(folder.resolve())  # recorded in the run's configuration: eval and generate read it
    tok = tokenizer_for(cfg.tokenizer)
    assert tok.end == tok.encode(b"</s>")[0] and tok.vocabulary == 300
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    pieces = instructions.pieces_of(chat, tok, "")
    assert [(tok.decode(p), c) for p, c in pieces] == [("<user>Hi?</s>", False), ("<assistant>", False),
                                                      ("Hello.</s>", True)]
    pair = instructions.pieces_of({"prompt": "<user>Hi?</s><assistant>", "response": "Hello."}, tok, "")
    assert [t for p, _ in pair for t in p] == [t for p, _ in pieces for t in p]  # the end token after the answer


def _as_pairs(chats: Path, out: Path, prompt: str, end: str) -> Path:
    """The chats of `chats` (a user turn, an assistant turn) as prompt/response pairs written as the chat renders
    them: `prompt` formats the user's content, `end` follows the answer."""
    lines = [json.loads(line)["messages"] for line in chats.read_text().splitlines()]
    return _lines(out, *({"prompt": prompt.format(m[0]["content"]), "response": m[1]["content"] + end}
                         for m in lines))


def test_chats_parquet_and_renamed_columns_give_the_windows_of_the_same_pairs(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The same examples as chats (plain, and through a tokenizer's template), as a parquet file read by datasets
    and under other column names: the same windows as the prompt/response lines written the same way, so the
    same training; and the command line trains the parquet file to the JSON lines' loss."""
    datasets = pytest.importorskip("datasets")
    chats = write_examples(tmp_path / "chats.jsonl", 60, chat=True)
    pairs = _as_pairs(chats, tmp_path / "pairs.jsonl", "user: {}\nassistant: ", "\n")
    want = instructions.load(str(pairs), 96, "bytes", 5, 5)
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    datasets.Dataset.from_list([{"q": r["prompt"], "a": r["response"]} for r in rows]).to_parquet(
        str(tmp_path / "qa.parquet"))
    for path, columns in ((chats, None), (tmp_path / "pairs.parquet", None),
                          (tmp_path / "qa.parquet", "prompt=q,response=a")):
        got = instructions.load(str(path), 96, "bytes", 5, 5, columns)
        assert all(torch.equal(a, b) for s in ("train", "val", "test") for a, b in
                   zip(getattr(got, s), getattr(want, s), strict=True)), path
    folder = _tokenizer_folder(tmp_path / "model")
    templated = _as_pairs(chats, tmp_path / "templated.jsonl", "<user>{}</s><assistant>", "")
    assert all(torch.equal(a, b) for a, b in zip(instructions.load(str(chats), 96, str(folder), 5, 5).train,
                                                 instructions.load(str(templated), 96, str(folder), 5, 5).train,
                                                 strict=True))
    losses = []
    for path in (pairs, tmp_path / "qa.parquet"):
        assert main_code(["train", "--dataset", "jsonl", "--data-dir", str(path), "--context", "96", "--width", "32",
                          "--depth", "1", "--heads", "2", "--steps", "5", "--val-size", "5", "--test-size", "5",
                          "--no-tensorboard", "--out", str(tmp_path / path.stem), "--quiet"] +
                         (["--columns", "prompt=q,response=a"] if path.suffix == ".parquet" else [])) == 0
        losses.append(json.loads((tmp_path / path.stem / "summary.json").read_text())["test_loss"])
    assert losses[0] == losses[1]
    capsys.readouterr()
    assert main_code(["eval", str(tmp_path / "pairs"), "--data-dir", str(pairs)]) == 0  # the examples it held out
    said = capsys.readouterr().out
    assert f"test_loss {losses[0]:.4f}" in said and f"test_perplexity {math.exp(losses[0]):.4f}" in said, said
    assert "5 jsonl test examples: the examples' test split" in said
    assert main_code(["eval", str(tmp_path / "pairs"), "--data-dir", str(chats)]) == 0  # another file: all of it
    assert "60 jsonl test examples: every example of chats.jsonl (not the run's own file)" in capsys.readouterr().out


def test_a_chat_template_that_refuses_a_chat_is_one_line_and_columns_keep_the_others(tmp_path: Path) -> None:
    def strict(messages: list[dict], generation: bool) -> str:
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    tok = tokenizer_for("bytes")
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(UserError, match=r"^x:3: the tokenizer's chat template refuses this chat \(Conversation roles"):
        instructions.pieces_of(chat, type(tok)(tok.name, tok.vocabulary, tok.encode, tok.decode, chat=strict), "x:3")
    path = _lines(tmp_path / "e.jsonl", *[{"question": "a", "response": "b"}] * 3)  # one column renamed
    assert instructions.load(str(path), 16, "bytes", 1, 1, "prompt=question").train[0].shape == (1, 16)


@pytest.mark.parametrize(("columns", "says"), [("prompt=q", "'q', which the example does not hold"),
                                               ("question=q", "give prompt=COL,response=COL or messages=COL")])
def test_bad_columns_are_one_line(tmp_path: Path, columns: str, says: str) -> None:
    path = _lines(tmp_path / "e.jsonl", *[{"prompt": "a", "response": "b"}] * 3)
    with pytest.raises(UserError, match=says):
        instructions.load(str(path), 16, "bytes", 1, 1, columns)


def test_a_damaged_parquet_file_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "e.parquet").write_bytes(b"PAR1 not a table")
    with pytest.raises(UserError, match="e.parquet: Hugging Face datasets cannot read it"):
        instructions.load(str(tmp_path / "e.parquet"), 16, "bytes", 1, 1)
