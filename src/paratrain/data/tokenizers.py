"""Tokenizers of --tokenizer: bytes (a vocabulary of 256, no dependency, every UTF-8 text), a tiktoken encoding
by name (gpt2, cl100k_base, ...), or a Hugging Face `tokenizers` file (tokenizer.json) or hub name, where
those libraries are installed. One `Tokenizer` shape for all: a name (recorded in the run's checkpoints, so
that `paratrain generate` decodes with the same), a vocabulary size, encode and decode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config.fields import TOKENIZER_FILES, has_tokenizer
from ..core.errors import UserError
from ..core.optional import how_to_install

BYTES = "bytes"


@dataclass(frozen=True)
class Tokenizer:
    name: str
    vocabulary: int
    encode: Callable[[bytes], list[int] | np.ndarray]  # UTF-8 bytes -> token ids
    decode: Callable[[list[int]], str]
    fingerprint: str = ""  # what tells two versions of one tokenizer file apart (the text cache's key has it)
    end: int | None = None  # the token that ends an answer (instructions.py), where the tokenizer has one
    # a chat template: (messages, add_generation_prompt) -> the chat's text, where the tokenizer has one
    chat: Callable[[list[dict], bool], str] | None = None

    @property
    def dtype(self) -> type:
        """The smallest unsigned integer that holds every id (the token cache's)."""
        return np.uint8 if self.vocabulary <= 256 else np.uint16 if self.vocabulary <= 65536 else np.uint32


def _bytes() -> Tokenizer:
    return Tokenizer(BYTES, 256, lambda b: np.frombuffer(b, dtype=np.uint8).copy(),
                     lambda ids: bytes(int(i) for i in ids).decode("utf-8", errors="replace"))


def tokenizer_for(name: str) -> Tokenizer:
    """The tokenizer `name` names (see the module's docstring); a one-line UserError where it cannot be had."""
    if name == BYTES:
        return _bytes()
    if Path(name).is_dir():
        return from_model_folder(Path(name))
    if Path(name).suffix == ".json" or Path(name).is_file():
        if not Path(name).is_file():
            raise UserError(f"--tokenizer {name}: no such file; give a tokenizer.json, bytes, or a name such as gpt2")
        return _from_file(Path(name))
    tiktoken = _tiktoken(name)
    return tiktoken if tiktoken is not None else _from_hub(name)


def _tokenizers(name: str) -> Any:
    """Hugging Face tokenizers' Tokenizer class, or the one line that says to install it."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise UserError(f"--tokenizer {name}: not bytes or a tiktoken encoding (gpt2, cl100k_base), and a tokenizer "
                        f"file or a Hugging Face hub name needs Hugging Face tokenizers: "
                        f"{how_to_install('tokenizers')}") from None
    return HFTokenizer


def _from_file(path: Path) -> Tokenizer:
    try:
        tok = _tokenizers(str(path)).from_file(str(path))
    except Exception as e:  # noqa: BLE001 (a missing or malformed file: the library's own exceptions)
        raise UserError(f"--tokenizer {path}: not a tokenizer file tokenizers can read ({e})") from None
    stat = path.stat()  # an edited file is another tokenizer: the text's cache is made again
    return _hf(str(path.resolve()), tok, f"{stat.st_size}-{stat.st_mtime_ns}")


def _hf(name: str, tok: object, fingerprint: str = "") -> Tokenizer:
    # no special tokens added: a piece of the text is no sequence of its own (a BOS at every piece's start)
    return Tokenizer(name, tok.get_vocab_size(),  # type: ignore[attr-defined]
                     lambda b: tok.encode(b.decode("utf-8"), add_special_tokens=False).ids,  # type: ignore[attr-defined]
                     lambda ids: tok.decode([int(i) for i in ids]), fingerprint)  # type: ignore[attr-defined]


def _tiktoken(name: str) -> Tokenizer | None:
    """A tiktoken encoding by name; None where tiktoken is not installed or knows no such name."""
    try:
        import tiktoken
    except ImportError:
        return None
    if name not in tiktoken.list_encoding_names():
        return None
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 (its first use downloads the vocabulary)
        raise UserError(f"--tokenizer {name}: tiktoken could not load it ({type(e).__name__}: {str(e)[:120]}); "
                        "its first use downloads the vocabulary: run once where the internet can be reached, or "
                        "give --tokenizer bytes") from None
    return Tokenizer(name, enc.n_vocab, lambda b: enc.encode_ordinary(b.decode("utf-8")),
                     lambda ids: enc.decode([int(i) for i in ids]))


def _from_hub(name: str) -> Tokenizer:
    tokenizers = _tokenizers(name)
    try:
        tok = tokenizers.from_pretrained(name)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"--tokenizer {name}: not bytes, a tokenizer file, or a tokenizer tiktoken or the Hugging "
                        f"Face hub knows ({type(e).__name__}); give --tokenizer bytes, a tokenizer.json, or a "
                        "name such as gpt2") from None
    return _hf(name, tok)


def from_model_folder(folder: Path) -> Tokenizer:
    """The tokenizer a model folder holds, read by transformers without network access: its end token, and its
    chat template where it has one."""
    from ..core.optional import require

    if not has_tokenizer(folder):
        raise UserError(f"--tokenizer {folder}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES)}); give "
                        "a folder a tokenizer's save_pretrained wrote, a tokenizer.json, or bytes")
    require("transformers", f"--tokenizer {folder}")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (a damaged or foreign file: the library's own exceptions)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"--tokenizer {folder}: transformers cannot read its tokenizer ({first})") from None
    stamp = "-".join(f"{(folder / f).stat().st_size}-{(folder / f).stat().st_mtime_ns}"
                     for f in TOKENIZER_FILES if (folder / f).is_file())
    chat = None
    if getattr(tok, "chat_template", None):
        def chat(messages: list[dict], generation: bool) -> str:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return Tokenizer(str(folder.resolve()), len(tok),
                     lambda b: tok.encode(b.decode("utf-8"), add_special_tokens=False),
                     lambda ids: tok.decode([int(i) for i in ids]), stamp, tok.eos_token_id, chat)
