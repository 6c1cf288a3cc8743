"""Instruction and chat examples (--dataset jsonl): a file of JSON lines, each an example, either a
{"prompt", "response"} pair or a {"messages": [{"role", "content"}, ...]} chat. Each example becomes one window
of --context tokens whose targets count the answer's tokens alone: the response, or a chat's assistant turns.
The prompt's targets and the padding's are IGNORE (-100), so the loss is the mean over the answers' tokens of the
global batch (losses.token_weights weighs each worker's share by its counted tokens, so N workers equal one
device as on any padded data).

- Tokens: the run's tokenizer (bytes by default; data/tokenizers.py), the prompt and the answer tokenized apart,
  so that the boundary between them is a token boundary; the tokenizer's end token after each answer, where it
  has one (bytes have none).
- A chat: through the tokenizer's chat template where it has one (a model folder's, --model hf:PATH), each turn
  rendered as the template renders the chat up to it; otherwise each message as "role: content" on its own lines.
- An example longer than the window is cut at its end (its answer shortened); one whose prompt fills the window
  would count nothing, and is left out: both counted in one warning line as the file is read.
- Windows are padded on the right: a causal model's counted positions never see the padding.
- Validation and test examples are held out of the file as other tables are (a seeded draw: a tenth for test,
  then a tenth of the rest for validation; or --val-size/--test-size examples).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UserError
from .splits import IGNORE
from .tokenizers import Tokenizer, tokenizer_for

ASSISTANT = "assistant"  # the role whose turns a chat's loss counts


def load(path: str | None, context: int, tokenizer: str | Tokenizer, val_size: int | None,
         test_size: int | None, columns: str | None = None, hold_out: bool = True, pack: bool = False) -> Any:
    """The examples of the file at `path` (JSON lines, or a parquet or arrow file read by Hugging Face datasets) as
    windows of `context` tokens, split three ways. `columns`: "prompt=COL,response=COL" or "messages=COL", where
    the file names them otherwise. `hold_out` False: every example is a test example (another file evaluated).
    `pack`: each split's examples packed several to a window (packing.py), after the split is drawn, so that the
    same examples are held out either way. Examples cut or left out are said in one warning line, where any are."""
    from .tables import split_rows

    if not path:
        raise UserError("--dataset jsonl needs --data-dir FILE.jsonl: JSON lines of {\"prompt\", \"response\"} or "
                        "{\"messages\": [...]}")
    where = Path(path).expanduser()
    if not where.is_file():
        raise UserError(f"--data-dir {where}: no such file; give a file of JSON lines (.jsonl), or a .parquet or "
                        ".arrow file")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer_for(tokenizer)
    named = _columns(columns)
    rows = _table(where) if where.suffix.lower() in TABLES else _examples(where)
    pieces = [pieces_of(_renamed(example, named), tok, f"{where}:{line}") for line, example in rows]
    if len(pieces) < 3:
        raise UserError(f"{where} holds {len(pieces)} example(s); give at least 3 (to train, validate and test)")
    x, y, cut = windows(pieces, context)
    kept = (y != IGNORE).any(dim=1)  # an example whose prompt fills the window teaches nothing: left out
    if int(kept.sum()) < 3:
        raise UserError(f"{where}: {int(kept.sum())} of its {len(y)} examples leave an answer token in a window of "
                        f"--context {context} (the prompts fill the rest); give a longer --context or shorter prompts")
    left_out = len(y) - int(kept.sum())
    if cut or left_out:
        print(f"paratrain: warning: {where.name}: of its {len(y)} examples {cut} are cut at the end of a window of "
              f"--context {context} and {left_out} left out (their prompts fill it); a longer --context keeps them",
              file=sys.stderr, flush=True)
    splits = split_rows({"x": x[kept], "y": y[kept]}, where, val_size, test_size, names=None, hold_out=hold_out)
    text = {"tokenizer": tok.name, "context": context, "examples": len(y), "cut": cut, "left_out": left_out,
            "answer_tokens": int((y != IGNORE).sum()), "bytes_per_token": {"val": None, "test": None}}
    if pack:
        splits, text["packed"] = packed(splits)
    return replace(splits, name="jsonl", vocabulary=tok.vocabulary, text=text)


def packed(splits: Any) -> tuple[Any, dict]:
    """`splits` with each split's examples packed into windows (packing.pack), and what the training split's
    packing gave (its examples, windows and how full they are) with the test split's examples."""
    from .packing import pack

    done = {name: pack(*getattr(splits, name)) for name in ("train", "val", "test")}
    said = {**done["train"][2], "test_examples": done["test"][2]["examples"]}
    return replace(splits, **{name: (x, y) for name, (x, y, _) in done.items()}), said


TABLES = (".parquet", ".arrow")  # read by Hugging Face datasets; any other file is JSON lines
WHAT = ("prompt", "response", "messages")  # what --columns may name


def _columns(columns: str | None) -> dict[str, str]:
    """--columns as {the file's column: what it holds}."""
    if not columns:
        return {}
    named = dict(part.split("=", 1) if "=" in part else ("", part) for part in columns.split(","))
    bad = [k for k in named if k.strip() not in WHAT] or [v for v in named.values() if not v.strip()]
    if bad:
        raise UserError(f"--columns {columns}: give prompt=COL,response=COL or messages=COL (each the name of a "
                        "column of the file)")
    return {v.strip(): k.strip() for k, v in named.items()}


def _renamed(example: dict, named: dict[str, str]) -> dict:
    if not named:
        return example
    missing = [c for c in named if c not in example]
    if missing:
        raise UserError(f"--columns names '{missing[0]}', which the example does not hold (it holds "
                        f"{', '.join(map(repr, example))})")
    return {**{k: v for k, v in example.items() if k not in named}, **{named[c]: example[c] for c in named}}


def _table(where: Path) -> Iterator[tuple[int, dict]]:
    """The rows of a parquet or arrow file, read by Hugging Face datasets (no network, nothing cached), each with
    its row number (from 1)."""
    from ..core.optional import require

    require("datasets", f"--data-dir {where.name}")
    import datasets

    try:
        table = datasets.Dataset.from_parquet(str(where), keep_in_memory=True) if where.suffix.lower() == \
            ".parquet" else datasets.Dataset.from_file(str(where), in_memory=True)
    except Exception as e:  # noqa: BLE001 (a damaged or foreign file: the libraries' own exceptions)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{where}: Hugging Face datasets cannot read it ({first}); give a parquet or arrow file "
                        "that datasets wrote, or JSON lines") from None
    yield from enumerate(table, 1)


def _examples(where: Path) -> Iterator[tuple[int, dict]]:
    """Each non-blank line's object, with its line number; a line that is not one is named in one line."""
    try:
        lines = where.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text (byte {e.start} is not): give JSON lines in UTF-8") from None
    except OSError as e:
        raise UserError(f"cannot read {where} ({e.strerror or e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}:{n} is not JSON ({e.msg}, column {e.colno}); give one JSON object a line") \
                from None
        if not isinstance(example, dict):
            raise UserError(f"{where}:{n} is a JSON {type(example).__name__}, not an object; give "
                            "{\"prompt\": ..., \"response\": ...} or {\"messages\": [...]} a line")
        yield n, example


def pieces_of(example: dict, tok: Tokenizer, where: str) -> list[tuple[list[int], bool]]:
    """An example's tokens as pieces, each with whether the loss counts it: a pair's prompt (not) and response
    (counted, with the end token), or a chat's turns (its assistant turns counted)."""
    if "messages" in example:
        return _chat(example["messages"], tok, where)
    if not isinstance(example.get("prompt"), str) or not isinstance(example.get("response"), str):
        raise UserError(f"{where}: an example needs \"prompt\" and \"response\" strings, or \"messages\" (it holds "
                        f"{', '.join(map(repr, example)) or 'nothing'}); --columns names yours "
                        "(prompt=COL,response=COL)")
    return [(_ids(tok, example["prompt"]), False), (_ids(tok, example["response"]) + _end(tok), True)]


def _chat(messages: Any, tok: Tokenizer, where: str) -> list[tuple[list[int], bool]]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise UserError(f"{where}: \"messages\" must be a list of {{\"role\", \"content\"}} strings")
    if not any(m["role"] == ASSISTANT for m in messages):
        raise UserError(f"{where}: the chat has no \"{ASSISTANT}\" turn, so nothing to learn; give one")
    if tok.chat is None:  # no template: each message a line "role: content"
        return _plain_chat(messages, tok)
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] == ASSISTANT:  # its header is the prompt's (as a generation prompt renders it)
            header = _render(tok, messages[:i], True, where)
            pieces.append((_ids(tok, _after(header, done, where)), False))
            done = header
        text = _render(tok, messages[: i + 1], False, where)
        pieces.append((_ids(tok, _after(text, done, where)), m["role"] == ASSISTANT))
        done = text
    return pieces


def _plain_chat(messages: list[dict], tok: Tokenizer) -> list[tuple[list[int], bool]]:
    pieces = []
    for m in messages:
        if m["role"] == ASSISTANT:
            pieces += [(_ids(tok, f"{ASSISTANT}: "), False), (_ids(tok, f"{m['content']}\n") + _end(tok), True)]
        else:
            pieces.append((_ids(tok, f"{m['role']}: {m['content']}\n"), False))
    return pieces


def _render(tok: Tokenizer, messages: list[dict], generation: bool, where: str) -> str:
    """The chat so far through the tokenizer's template; a template that refuses it (roles that must alternate, a
    system turn it does not take) in one line."""
    try:
        return tok.chat(messages, generation)  # type: ignore[misc]
    except Exception as e:  # noqa: BLE001 (the template's own errors: jinja's, or its raise_exception)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{where}: the tokenizer's chat template refuses this chat ({first}); give chats it takes, "
                        "or {\"prompt\", \"response\"} pairs") from None


def _after(text: str, done: str, where: str) -> str:
    """What the template added to the chat rendered so far (a template that renders a turn's past anew cannot be
    cut into turns)."""
    if not text.startswith(done):
        raise UserError(f"{where}: the tokenizer's chat template renders an earlier turn anew when a turn is added, "
                        "so its turns cannot be told apart; give {\"prompt\", \"response\"} pairs")
    return text[len(done):]


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return [int(i) for i in tok.encode(text.encode("utf-8"))] if text else []


def _end(tok: Tokenizer) -> list[int]:
    return [] if tok.end is None else [tok.end]


def windows(examples: list[list[tuple[list[int], bool]]], context: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Inputs and targets (N x context, int64): each example's tokens, cut at context + 1 and padded on the right
    (inputs with 0, targets with IGNORE); a target counts where its token is of a counted piece. And how many
    examples were cut."""
    x = torch.zeros(len(examples), context, dtype=torch.int64)
    y = torch.full((len(examples), context), IGNORE, dtype=torch.int64)
    cut = 0
    for i, pieces in enumerate(examples):
        ids = torch.tensor([t for p, _ in pieces for t in p], dtype=torch.int64)
        counts = torch.tensor([c for p, c in pieces for _ in p], dtype=torch.bool)
        cut += len(ids) > context + 1
        ids, counts = ids[: context + 1], counts[: context + 1]
        n = len(ids) - 1
        if n < 1:
            continue
        x[i, :n] = ids[:-1]
        y[i, :n] = torch.where(counts[1:], ids[1:], IGNORE)
    return x, y, cut
