"""Tensors of any shape as a Splits (kind "tensors"), checked in one line each; and a table or a tensors file
read into them (--dataset tensors, --dataset csv)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import UserError
from .columns import Columns
from .mapped import MappedTensor
from .splits import IGNORE, Splits


def tensor_splits(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str = "custom",
                  names: tuple[str, ...] | None = None, split: str | None = None, where: str = "data['{}']") -> Splits:
    """Inputs and targets of any shape (kind "tensors"), checked: the same shape an example in every split, a
    target for every input, every number finite. Float (and uint8: bytes, pixels) inputs and targets become
    float32 (a network's weights are; uint8 keeps its 0..255), other integers int64 (token ids, class
    indices). Targets that are one integer an example are class indices 0..K-1 (accuracy means something, and
    cross-entropy is the default loss); any other targets are the loss's to judge (MSE by default, floats)."""
    x, y = pairs["train"]
    if not len(x):
        raise UserError(f"{where.format('train')} holds no examples; give it one or more")
    checked = {}
    for part, (inputs, targets) in pairs.items():
        if len(inputs) != len(targets):
            raise UserError(f"{where.format(part)} has {len(inputs)} inputs and {len(targets)} targets; give one "
                            "target per input")
        for what, t, like in (("inputs", inputs, x), ("targets", targets, y)):
            if t.shape[1:] != like.shape[1:]:
                raise UserError(f"{where.format(part)} {what} are {tuple(t.shape[1:])} an example, the training "
                                f"{what} {tuple(like.shape[1:])}; give every split the same shapes")
            if t.dtype.is_complex or t.dtype == torch.bool:
                raise UserError(f"{where.format(part)} {what} are {t.dtype}; give real numbers (float) or integers")
            row, _ = bad_rows(t)
            if row is not None:
                raise UserError(f"{where.format(part)} {what} hold NaN or inf (row {row} the first); drop or fill "
                                "those rows")
        # a memory-mapped input converts as it is read (mapped.MappedTensor); named columns converted themselves
        checked[part] = tuple(t if isinstance(t, MappedTensor | Columns) else t.float() if t.is_floating_point() or
                               t.dtype == torch.uint8 else t.long() for t in (inputs, targets))
    classes = 0
    if y.dim() == 1 and not y.is_floating_point():
        lowest = min(int(t.min()) for _, t in checked.values() if len(t))
        if lowest < 0:
            raise UserError(f"the targets are one integer an example, class indices, and must be 0..K-1; one is "
                            f"{lowest} (give float targets for a regression)")
        classes = max(int(t.max()) for _, t in checked.values() if len(t)) + 1
    vocabulary = 0
    if not x.is_floating_point() and x.dtype != torch.uint8:  # token ids, say: an embedding needs their range
        vocabulary = max(int(t.max()) for t, _ in checked.values() if t.numel()) + 1
        if not classes and y.dim() > 1 and not y.is_floating_point():  # next tokens: their ids count too
            vocabulary = max([vocabulary] + [int(t.max()) + 1 for _, t in checked.values() if t.numel()])
            low = min(int(t[t != IGNORE].min()) for _, t in checked.values() if bool((t != IGNORE).any()))
            if low < 0:
                raise UserError(f"the targets are token ids, and one is {low}: give ids 0..V-1, and -100 for a "
                                "position no loss counts (padding)")
    return Splits(name, checked["train"], checked["val"], checked["test"], (), (), classes, classes=names,
                  split=split, kind="tensors", vocabulary=vocabulary)


def bad_rows(t: torch.Tensor | MappedTensor) -> tuple[int | None, int]:
    """The first row holding NaN or inf (None: no row does) and how many do; a memory-mapped input is read a
    chunk at a time."""
    first, count, seen = None, 0, 0
    if not t.is_floating_point() or not len(t):
        return first, count
    for chunk in t.chunks() if isinstance(t, MappedTensor) else [t]:
        bad = ~torch.isfinite(chunk.reshape(len(chunk), -1)).all(1)
        if first is None and bad.any():
            first = seen + int(bad.nonzero()[0])
        count, seen = count + int(bad.sum()), seen + len(chunk)
    return first, count


def as_numbers(splits: Splits) -> Splits:
    """Class-index targets taken as numbers (float32): a regression on them, for a --loss that compares
    numbers."""
    from dataclasses import replace

    pairs = {s: (getattr(splits, s)[0], getattr(splits, s)[1].float()) for s in ("train", "val", "test")}
    return replace(splits, num_classes=0, classes=None, **pairs)


def standardized(splits: Splits) -> Splits:
    """--standardize: the training inputs' mean and standard deviation per element (float64 sums, so no
    thread count shows), which the batch transform (TensorPipeline) applies; a constant element keeps its
    scale."""
    from dataclasses import replace

    x = splits.train[0]
    if not x.is_floating_point():
        raise UserError(f"--standardize scales float features; these inputs are {x.dtype} (token ids, say): leave "
                        "it out")
    def flats() -> Any:  # float64 rows, a chunk at a time where the input stays in its file
        return (c.reshape(len(c), -1).double() for c in (x.chunks() if isinstance(x, MappedTensor) else [x]))

    n = len(x)
    mean = sum(f.sum(0) for f in flats()) / n  # two passes, as torch.std makes them
    var = sum(((f - mean) ** 2).sum(0) for f in flats()) / (n - 1) if n > 1 else torch.ones_like(mean)
    std = var.sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    return replace(splits, mean=tuple(mean.tolist()), std=tuple(std.tolist()))
