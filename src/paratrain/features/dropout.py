"""Dropout masks that one device would draw, whatever the number of workers.

A worker computes its rows of the global batch. With torch's own dropout, its masks come from its own
generator's stream over its own rows, so 2 workers drop other units than 1 device does, and the runs part
(GPT-2's dropout 0.1: validation 2.108 against 2.173 after 300 steps). Here, every dropout call of a step draws
the mask of the whole global micro-batch, from a generator seeded by (seed, step, micro-batch, the call's place
in the forward) alone, and each worker keeps its own rows: an example's mask is a function of its place in the
global batch, the step and the call's place in the forward (the layer), never of the rank. It costs each worker
the drawing of the whole batch's masks (measured in docs/explanations/equal-to-one-device.md).

A pipeline's stage runs some of the calls, on one micro-batch of its copy at a time: it `place`s the mode at its
chunk's rows and its first call's place (the calls of the stages before it), so its masks are one device's too.
Tensor parallelism's workers of one copy take the same rows and draw the same masks: one device's where the
dropout is on whole (replicated) activations; on split ones (attention dropout over split heads) each worker's
heads get the same mask, which one device would not draw.

It intercepts dropout where a network calls it (torch.nn.functional's dropout, dropout1d/2d/3d, and
scaled_dot_product_attention's dropout_p, run as its plain formula so that the mask can be drawn) through a
TorchFunctionMode, around the forward and backward of a micro-batch. A call whose first dimension is not the
worker's rows (a tower's replicas, a network that puts the batch elsewhere) cannot be placed in the global
batch: its mask is drawn for its own shape, from a generator with the copy in its seed, which matches one device
in distribution only.

Under --compile the placed mask is one operator of the graph (`global_batch_mask`, a custom op): its generator is
made and drawn inside it, from the micro-batch's seed and the call's number, both tensors (the op counts the call
in its tensor). Made in the traced code, the generator broke the graph at every dropout call; the seed, a Python
number, was a guard that failed every step; and the call's number, a Python number, made each block compiled on
its own (fsdp's and tp's units) a graph of its own, past 8 blocks run uncompiled.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

UNPLACED = 1 << 40  # in the seed of the masks that cannot be placed: never a placed call's number
CHANNELS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}  # one draw a channel: the spatial dims see one value


# where a Hugging Face model's configuration keeps the dropout it passes as a number (Llama's attention_dropout
# reaches scaled_dot_product_attention with no dropout layer)
CONFIG_DROPOUTS = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                   "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout")


def has_dropout(model: nn.Module) -> bool:
    """Whether `model` drops anything: a dropout layer with p > 0, or a Hugging Face configuration's dropout
    above 0. Only then is the mode worth its cost."""
    config = getattr(model, "config", None)
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()) or \
        any(isinstance(getattr(config, name, None), float) and getattr(config, name) > 0 for name in CONFIG_DROPOUTS)


def mixed_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (the run's seed, the step, the micro-batch, a rank)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << 63)
    return value


# where a mode's calls draw from, kept in one CPU int64 tensor (GlobalBatchDropout.where): read in the traced code,
# Python numbers would be constants that a compiled graph guards (a block compiled on its own, as fsdp and tp
# compile them, was compiled anew for each block and each pipeline chunk, and past 8 ran uncompiled)
CALL, PLACED, OTHERS, WHICH, OF = range(5)  # the next call's number, calls placed, calls not, the share, of how many


@torch.library.custom_op("paratrain::global_batch_mask", mutates_args=("where",))
def global_batch_mask(seed: torch.Tensor, where: torch.Tensor, rows: int, per_row: list[int], p_keep: float,
                      device: torch.device) -> torch.Tensor:
    """The next placed call's mask, counted in `where` (its CALL and PLACED advance by one): rows
    [which * rows, (which + 1) * rows) of the 0/1 float32 mask of a global micro-batch of rows * of rows (each of
    shape `per_row`), drawn from (seed, call) alone. `seed`, `where`: CPU int64 tensors, which a compiled graph
    takes as inputs rather than constants to guard."""
    where[CALL] += 1
    where[PLACED] += 1
    call, which, of = int(where[CALL]), int(where[WHICH]), int(where[OF])
    drawn = torch.Generator(device).manual_seed(mixed_seed(int(seed.item()), call))
    whole = torch.empty((rows * of, *per_row), dtype=torch.float32, device=device).bernoulli_(p_keep, generator=drawn)
    return whole[which * rows:(which + 1) * rows].clone()


@global_batch_mask.register_fake
def _(seed: torch.Tensor, where: torch.Tensor, rows: int, per_row: list[int], p_keep: float,
      device: torch.device) -> torch.Tensor:
    return torch.empty((rows, *per_row), dtype=torch.float32, device=device)


class GlobalBatchDropout(TorchFunctionMode):
    """Within it, dropout draws the global micro-batch's masks and applies this worker's rows of them.
    `share`: (which, of how many) equal shares of the global micro-batch is this worker's, of `rows` examples;
    `seed`: the micro-batch's (mixed_seed of the run's seed, the step and the micro-batch), the same on every
    worker; `rank`: for the calls that cannot be placed in the global batch."""

    current: GlobalBatchDropout | None = None  # the mode a pipeline's stage places (one at a time a process)

    def __init__(self, device: torch.device, share: tuple[int, int], rows: int, seed: int, rank: int) -> None:
        super().__init__()
        self.rows, self.device, self.seed, self.rank = rows, device, seed, rank
        self.seed_tensor = torch.tensor(seed, dtype=torch.int64, device="cpu")  # the placed masks' (global_batch_mask)
        self.where = torch.tensor([0, 0, 0, *share], dtype=torch.int64, device="cpu")  # CALL, PLACED, OTHERS, WHICH, OF
        self.own: dict[torch.device, torch.Generator] = {}  # by device: a tower's replicas are on several

    # read outside the traced code (a pipeline's stages, the tests): the calls so far, those placed in the global
    # batch (drawn as one device would) and the others
    call = property(lambda self: int(self.where[CALL]))
    placed = property(lambda self: int(self.where[PLACED]))
    unplaced = property(lambda self: int(self.where[OTHERS]))

    def __enter__(self) -> GlobalBatchDropout:
        GlobalBatchDropout.current = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        GlobalBatchDropout.current = None
        super().__exit__(*exc)

    def place(self, which: int, of: int, call: int) -> None:
        """The next calls are on share `which` of `of` of the global micro-batch (a pipeline's chunk of its
        copy's rows), the first of them the forward's call number `call`."""
        self.where[WHICH], self.where[OF], self.where[CALL] = which, of, call

    def snapshot(self) -> tuple:
        """Where the next call draws from: its place, and the unplaced masks' generators' states
        (activation checkpointing's recomputation draws again from there: features/recompute.py)."""
        states = {device: generator.get_state() for device, generator in self.own.items()}
        return self.where.clone(), states

    def restore(self, snapshot: tuple) -> None:
        where, states = snapshot
        self.where.copy_(where)
        for device, state in states.items():
            self.own.setdefault(device, torch.Generator(device)).set_state(state)
        for device in set(self.own) - set(states):  # made since: drawn anew from its seed
            del self.own[device]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout or func in CHANNELS:
            return self._dropout(func, *args, **kwargs)
        if func is F.scaled_dot_product_attention and _sdpa_dropout(args, kwargs) > 0:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, func: Any, input: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or p == 0:
            return input
        if p >= 1:
            return input.mul_(0) if inplace else input * 0
        # a channel dropout draws one value a channel: N x C x 1 ... (C x 1 ... for an input without a batch;
        # torch's dropout2d takes a 3-D input as N x C x L)
        kept = 0 if func not in CHANNELS else 2 if input.dim() > CHANNELS[func] + 1 or \
            (func is F.dropout2d and input.dim() == 3) else 1
        shape = input.shape if not kept else (*input.shape[:kept], *(1,) * (input.dim() - kept))
        # in float32: 1 / (1 - p) in bfloat16 is 1.109 for p = 0.1, which would shrink every layer's output
        keep = self._mask(tuple(shape), 1 - p, input).div_(1 - p)
        dropped = (input.float() * keep).to(input.dtype)
        return input.copy_(dropped) if inplace else dropped

    def _mask(self, shape: tuple[int, ...], p_keep: float, like: torch.Tensor) -> torch.Tensor:
        """A 0/1 float32 mask of `shape` on `like`'s device: this worker's rows of the global batch's mask where `shape`
        starts with its rows (or with its rows times a whole number: its rows flattened with a sequence's
        positions, row by row)."""
        make = lambda dims: torch.empty(dims, dtype=torch.float32, device=like.device)  # noqa: E731
        if not shape or not self.rows or shape[0] % self.rows or like.device != self.device:
            self.where[CALL] += 1
            self.where[OTHERS] += 1
            if like.device not in self.own:
                seed = mixed_seed(self.seed, UNPLACED, self.rank)
                self.own[like.device] = torch.Generator(like.device).manual_seed(seed)
            return make(shape).bernoulli_(p_keep, generator=self.own[like.device])
        per_row = [shape[0] // self.rows, *shape[1:]]
        return global_batch_mask(self.seed_tensor, self.where, self.rows, per_row, p_keep, like.device).reshape(shape)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        """scaled_dot_product_attention by its formula, its attention weights dropped out as above."""
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        if enable_gqa:  # fewer key/value heads than query heads: each serves a group
            groups = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        scores = query @ key.transpose(-2, -1) * scale
        if is_causal:
            length, span = query.shape[-2], key.shape[-2]
            causal = torch.ones(length, span, dtype=torch.bool, device=query.device).tril()  # top-left, as torch
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else \
                scores + attn_mask
        weights = self._dropout(F.dropout, scores.softmax(-1), dropout_p)
        return weights @ value


def masks(drops: bool, strategy: Any, cfg: Any, step: int, k: int) -> contextlib.AbstractContextManager:
    """Dropout of micro-batch `k` of `step` as one device draws it, for a worker of `strategy`, where the model
    `drops` anything (has_dropout); a pipeline's stage places each of its chunks (stages.py)."""
    if not drops:
        return contextlib.nullcontext()
    share, seed = strategy.batch_share, mixed_seed(cfg.seed, step, k)
    rows = cfg.batch_size // share[1] // strategy.chunks()
    return GlobalBatchDropout(strategy.ctx.device, share, rows, seed, share[0])


def _sdpa_dropout(args: tuple, kwargs: dict) -> float:
    return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
