"""Text as training data (--dataset text): a UTF-8 file, or a folder of .txt files, turned into tokens once
(bytes by default: a vocabulary of 256 and no dependency; or a tokenizer, tokenizers.py) and kept in a
memory-mapped token file in the user's cache, so that text larger than memory trains and a second run reads
nothing again.

The held-out text is contiguous: the validation tokens, then the test tokens, at the end of the text (an
example is a window of --context tokens, and its targets are the same window one token on). The training
windows of an epoch are the training tokens cut at an offset drawn from (seed, epoch), in an order drawn from
the same: each token is trained on once an epoch (but for at most two windows' worth at the ends), and the
global batch of a step is the same whatever the number of workers or a resume (`epoch_starts`, as
batches.epoch_permutation is for other data).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import UserError
from .decode import private_name, put_in_place
from .folder import locked, user_cache
from .source import MappedImages, delivered, host_indices, host_rows
from .splits import Splits
from .tokenizers import Tokenizer, tokenizer_for

CACHE_VERSION = 1
CHUNK_BYTES = 1 << 24  # what is read (and tokenized) at once: text larger than memory passes through in pieces
HELD_OUT_SHARE, HELD_OUT_MAX = 20, 256  # the default validation and test sets: a twentieth each, at most 256 windows


class TokenWindows(MappedImages):
    """Windows of `context` tokens of a 1-D token file, read on demand: in [lo, hi), one token on for `shift`
    1 (the targets). `by_start`: the training split's, whose items are named by the token they start at
    (epoch_starts draws them); otherwise the i-th item is the i-th window of a grid from `lo` (held-out
    splits, evaluated in order)."""

    REPLACED = " (the text's token cache was rebuilt: was the text changed?)"
    dtype = torch.int64

    def __init__(self, path: str, context: int, lo: int, hi: int, shift: int = 0, by_start: bool = False,
                 device: torch.device | str = "cpu", stamp: tuple[int, int, int] | None = None) -> None:
        super().__init__(path, None, device, stamp)
        self.context, self.lo, self.hi, self.shift, self.by_start = context, lo, hi, shift, by_start

    def __len__(self) -> int:
        """Windows an epoch (training: the grid's at any offset) or in the split."""
        return max(0, (self.hi - self.lo - 1) // self.context - (1 if self.by_start else 0))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), self.context))

    def dim(self) -> int:
        return 2

    ndim = 2

    def is_floating_point(self) -> bool:
        return False

    def numel(self) -> int:
        return len(self) * self.context

    def starts(self, idx: Any) -> np.ndarray:
        """The first token of each of the items `idx` (indices, or a slice)."""
        if isinstance(idx, torch.Tensor):
            idx = host_indices(idx)
        if isinstance(idx, slice):  # the training split's: every start whose targets stay in it
            idx = np.arange(*idx.indices(self.hi - self.lo - self.context if self.by_start else len(self)))
        idx = np.asarray(idx, dtype=np.int64)
        return self.lo + idx if self.by_start else self.lo + idx * self.context

    def __getitem__(self, idx: Any) -> torch.Tensor:
        """The windows `idx` (B x context token ids, int64) on this source's device."""
        if isinstance(idx, int | np.integer):
            return self[[int(idx)]][0]
        starts = self.starts(idx) + self.shift
        windows = np.lib.stride_tricks.sliding_window_view(self.array, self.context)
        order = np.argsort(starts, kind="stable")  # in file order: fewer page faults
        rows, t = host_rows((len(starts), self.context), np.dtype(np.int64), self.device)
        rows[order] = windows[starts[order]]  # token ids as int64, read into pinned memory for a GPU
        return delivered(t, self.device)

    def epoch_starts(self, seed: int, epoch: int) -> torch.Tensor:
        """The training windows of `epoch` by their first token: the grid at an offset, in an order, both drawn
        from (seed, epoch)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, self.context, (1,), generator=g))
        return offset + self.context * torch.randperm(len(self), generator=g)

    def to(self, device: torch.device | str) -> TokenWindows:
        return type(self)(self.path, self.context, self.lo, self.hi, self.shift, self.by_start, device, self.stamp)

    def min(self) -> torch.Tensor:
        return torch.tensor(0)

    def subset(self, rows: np.ndarray) -> TokenWindows:
        raise TypeError("a text's windows are taken by their starts, not as a subset of rows")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "context": self.context, "lo": self.lo, "hi": self.hi, "shift": self.shift,
                "by_start": self.by_start, "device": str(self.device), "stamp": self.stamp}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["context"], state["lo"], state["hi"], state["shift"],  # type: ignore[misc]
                      state["by_start"], state["device"], tuple(state["stamp"]))

    def __repr__(self) -> str:
        return f"TokenWindows({self.path!r}, {len(self)} windows of {self.context})"


def load(path: str | None, context: int, tokenizer: str, val_size: int | None, test_size: int | None,
         cache_dir: str | None = None, quiet: bool = True) -> Splits:
    """The text at `path` as windows of `context` tokens, split three ways (see the module's docstring)."""
    if not path:
        raise UserError("--dataset text needs --data-dir: a UTF-8 text file, or a folder of .txt files")
    files = text_files(Path(path))
    tok = tokenizer_for(tokenizer)
    cache = _cache_folder(files, tok, cache_dir)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with locked(cache, quiet):  # torchrun's ranks of one node build it once; the others wait, then open it
        manifest = _open(cache, files, tok) or _build(cache, files, tok)
    return _splits(cache / "tokens.npy", manifest, context, val_size, test_size, path, tok)


def text_files(root: Path) -> list[Path]:
    """The file, or the folder's .txt files in name order (one corpus, joined by a blank line)."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise UserError(f"--data-dir {root}: no such file or folder; give a UTF-8 text file or a folder of .txt files")
    found = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not found:
        raise UserError(f"{root} holds no .txt files; give a UTF-8 text file or a folder of .txt files")
    return found


def _stamps(files: list[Path]) -> list[list]:
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _cache_folder(files: list[Path], tok: Tokenizer, cache_dir: str | None) -> Path:
    key = hashlib.sha1(json.dumps([_stamps(files), tok.name, tok.fingerprint]).encode()).hexdigest()[:16]
    return (Path(cache_dir).expanduser() if cache_dir else user_cache() / "text") / key


def _open(cache: Path, files: list[Path], tok: Tokenizer) -> dict | None:
    """The cache's manifest, where it is whole and made from exactly these files by this tokenizer."""
    try:
        manifest = json.loads((cache / "manifest.json").read_text())
        tokens = np.load(cache / "tokens.npy", mmap_mode="r")
    except (OSError, ValueError):
        return None
    ok = manifest.get("version") == CACHE_VERSION and manifest.get("files") == _stamps(files) and \
        manifest.get("tokenizer") == tok.name and manifest.get("tokens") == len(tokens)
    return manifest if ok else None


def _build(cache: Path, files: list[Path], tok: Tokenizer) -> dict:
    """Tokenize the files a piece at a time into a raw file, then give it an .npy header (memory-mapped)."""
    tmp = private_name(cache, "building")
    tmp.mkdir()
    try:
        raw, count, size = tmp / "tokens.raw", 0, 0
        with open(raw, "wb") as out:
            for i, f in enumerate(files):
                for piece in _pieces(f, b"\n\n" if i else b""):
                    ids = np.asarray(tok.encode(piece), dtype=tok.dtype)
                    out.write(ids.tobytes())
                    count, size = count + len(ids), size + len(piece)
        if count < 3:
            raise UserError(f"the text holds {count} tokens; it needs more than a few to train, validate and test")
        tokens = np.lib.format.open_memmap(tmp / "tokens.npy", mode="w+", dtype=tok.dtype, shape=(count,))
        tokens[:] = np.memmap(raw, dtype=tok.dtype, mode="r", shape=(count,))
        tokens.flush()
        del tokens
        raw.unlink()
        manifest = {"version": CACHE_VERSION, "files": _stamps(files), "tokenizer": tok.name, "tokens": count,
                    "bytes": size, "vocabulary": tok.vocabulary}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        put_in_place(tmp, cache)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the text's token cache in {cache.parent} ({e.strerror or e}); set "
                        "--cache-dir to a folder you can write") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _pieces(path: Path, first: bytes):  # noqa: ANN202 (a generator of bytes)
    """The file's bytes CHUNK_BYTES at a time, cut after a newline where there is one (a tokenizer then never
    sees a word cut in two), checked as UTF-8."""
    rest, at = first, -len(first)  # at: the file offset of the piece's first byte
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; an unreadable file is the user's to fix)
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
    with f:
        while chunk := f.read(CHUNK_BYTES):
            chunk = rest + chunk
            # after a newline, else a space, else before the last character (which may be cut in two)
            cut = chunk.rfind(b"\n") + 1 or chunk.rfind(b" ") + 1 or _last_character(chunk)
            piece, rest = chunk[:cut], chunk[cut:]
            _check_utf8(piece, path, at)
            at += len(piece)
            yield piece
    if rest:
        _check_utf8(rest, path, at)
        yield rest


def _bytes_per_token(targets: TokenWindows, tok: Tokenizer) -> float | None:
    """The UTF-8 bytes a token of a held-out split (its targets, decoded once)."""
    if not len(targets):
        return None
    if tok.name == "bytes":
        return 1.0
    ids = targets[:].reshape(-1).tolist()
    return len(tok.decode(ids).encode("utf-8")) / len(ids)


def _last_character(chunk: bytes) -> int:
    """Where the last UTF-8 character of `chunk` starts (continuation bytes are 10xxxxxx)."""
    i = len(chunk) - 1
    while i > 0 and chunk[i] & 0xC0 == 0x80:
        i -= 1
    return i or len(chunk)


def _check_utf8(piece: bytes, path: Path, at: int) -> None:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {max(0, at + e.start)} is not): convert it (iconv -t "
                        "UTF-8), or give a text file") from None


def _splits(tokens: Path, manifest: dict, context: int, val_size: int | None, test_size: int | None,
            where: str, tok: Tokenizer) -> Splits:
    n = int(manifest["tokens"])
    windows = (n - 1) // context
    held = min(max(1, windows // HELD_OUT_SHARE), HELD_OUT_MAX)
    val_n, test_n = (held if s is None else s for s in (val_size, test_size))
    train_hi = n - 1 - (val_n + test_n) * context  # the last training target is the token before
    if train_hi < 2 * context + 1:
        raise UserError(f"{where} holds {n} tokens: too few for windows of --context {context} with {val_n} "
                        f"validation and {test_n} test windows held out; give more text, a shorter --context, or "
                        "a smaller --val-size/--test-size")
    stamp = os.stat(tokens)
    stamp_t = (stamp.st_ino, stamp.st_size, stamp.st_mtime_ns)
    val_lo, test_lo = train_hi, train_hi + val_n * context

    def pair(lo: int, hi: int, by_start: bool = False) -> tuple[TokenWindows, TokenWindows]:
        return tuple(TokenWindows(str(tokens), context, lo, hi, shift, by_start, stamp=stamp_t) for shift in (0, 1))

    train = pair(0, train_hi + 1, by_start=True)  # + 1: the last target
    val = pair(val_lo, test_lo + 1)
    test = pair(test_lo, test_lo + test_n * context + 1)
    text = {"tokenizer": manifest["tokenizer"], "context": context, "tokens": n,
            # the held-out text's own UTF-8 bytes a token, for bits per byte (1 for bytes)
            "bytes_per_token": {"val": _bytes_per_token(val[1], tok), "test": _bytes_per_token(test[1], tok)}}
    return Splits("text", train, val, test, (), (), 0, kind="tensors", vocabulary=int(manifest["vocabulary"]),
                  text=text)
