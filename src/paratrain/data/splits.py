"""The in-memory dataset every loader returns, split three ways: uint8 images and int64 labels (kind "images",
every dataset of the registry's, image folders, Datasets of images), or tensors of any shape and type with
targets of any shape and type (kind "tensors": a regression's floats, a sequence's token ids)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UserError

# (uint8 images N x C x H x W, int64 labels N); the images in memory, or rows of a cache file (source.py); or
# (inputs N x ..., targets N x ...) of kind "tensors"
Pair = tuple[Any, torch.Tensor]
KINDS = ("images", "tensors")
IGNORE = -100  # a target position that no loss counts (padding, a prompt; transformers' labels use it too)


@dataclass(frozen=True)
class Splits:
    name: str
    train: Pair
    val: Pair  # may hold zero examples (--val-size 0)
    test: Pair
    mean: tuple[float, ...]  # per channel, on the 0..1 scale, for batch-wise normalisation
    std: tuple[float, ...]
    num_classes: int = 10
    classes: tuple[str, ...] | None = None  # the class names, where the data has them (an image folder's)
    split: str | None = None  # how the held-out sets were chosen, where paratrain chose them (checkpoints keep it)
    kind: str = "images"  # or "tensors": no normalisation, augmentation or image shapes (KINDS)
    vocabulary: int = 0  # integer inputs (token ids): the largest id in any split + 1 (an embedding's size)
    # a file's rows and bytes, where paratrain held split rows out of it (tables.py): evaluation finds them again
    origin: dict | None = None
    # text (text.py): its tokenizer's name, the window (context), its tokens and UTF-8 bytes a token; generation
    # decodes with the tokenizer, bits per byte read the bytes
    text: dict | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Splits kind {self.kind!r}: one of {', '.join(KINDS)}")

    @property
    def images(self) -> bool:
        return self.kind == "images"

    @property
    def channels(self) -> int:
        return self.train[0].shape[1]

    @property
    def image_size(self) -> int:
        return self.train[0].shape[-1]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's input shape (C x H x W for images)."""
        return tuple(self.train[0].shape[1:])

    @property
    def target_shape(self) -> tuple[int, ...]:
        """One example's target shape: () for a class index or a single number."""
        return tuple(self.train[1].shape[1:])

    @property
    def classification(self) -> bool:
        """The targets are class indices (integers 0..num_classes-1, one an example): accuracy means something,
        and cross-entropy is the default loss."""
        return self.num_classes > 0

    @property
    def sequence(self) -> bool:
        """The targets are token ids, a sequence an example (N x T integers): the built-in cross-entropy takes
        N x T x V outputs against them, and the loss is a mean over the tokens (-100: ignored)."""
        return not self.images and not self.classification and len(self.target_shape) >= 1 and \
            not self.train[1].is_floating_point()

    @property
    def labelled(self) -> bool:
        """The inputs are named columns that hold "labels" (a Hugging Face batch's): the network is given them,
        and may return its own loss."""
        return "labels" in getattr(self.train[0], "names", ())

    @property
    def categorical(self) -> bool:
        """Integer targets the cross-entropy judges by default: class indices, or token ids."""
        return self.classification or self.sequence

    @property
    def tokens_per_example(self) -> int | None:
        """The tokens a language model reads an example (its input's length), where the inputs are token ids and
        the targets too (a classifier of sequences, the gru's, counts examples)."""
        x = self.train[0]
        return int(self.input_shape[0]) if self.sequence and len(self.input_shape) == 1 and \
            not x.is_floating_point() and x.dtype != torch.uint8 else None

    @property
    def num_outputs(self) -> int:
        """What a network's last layer gives an example: a score per class, or one number per target element."""
        return self.num_classes if self.classification else math.prod(self.target_shape)

    def shape_info(self) -> dict:
        """What a model is built for and fed with (saved in checkpoints): no images."""
        if not self.images:
            return {"kind": self.kind, "input_shape": list(self.input_shape), "input_dtype": str(self.train[0].dtype),
                    "target_shape": list(self.target_shape), "target_dtype": str(self.train[1].dtype),
                    "num_classes": self.num_classes, "mean": list(self.mean), "std": list(self.std),
                    "vocabulary": self.vocabulary, **({"held_out_of": self.origin} if self.origin else {}),
                    **({"text": self.text} if self.text else {}),
                    **({"columns": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in self.train[0].columns.items()}}
                       if hasattr(self.train[0], "columns") else {}),
                    **({"classes": list(self.classes)} if self.classes else {})}
        info = {"channels": self.channels, "image_size": self.image_size, "num_classes": self.num_classes,
                "mean": list(self.mean), "std": list(self.std)}
        if self.classes is not None:
            info["classes"] = list(self.classes)
        if self.split is not None:
            info["split"] = self.split
        path = getattr(self.test[0], "path", None)
        if self.split == "index-hash" and path:  # a Dataset's decoded cache: evaluate(run) finds its test split
            info["cache"] = str(Path(path).resolve().parent)
        return info

    @classmethod
    def shaped_like(cls, name: str, info: dict) -> Splits:
        """Empty splits of a checkpoint's shapes: enough to build its model and its batch transforms."""
        if info.get("kind", "images") != "images":
            dtype = lambda name: getattr(torch, name.removeprefix("torch."))  # noqa: E731
            inputs = torch.zeros(0, *info["input_shape"], dtype=dtype(info["input_dtype"]))
            if "columns" in info:  # named inputs (a Hugging Face batch's)
                from .columns import empty_like

                inputs = empty_like(info["columns"])
            targets = torch.zeros(0, *info["target_shape"], dtype=dtype(info["target_dtype"]))
            return cls(name, (inputs, targets), (inputs, targets), (inputs, targets), tuple(info.get("mean", ())),
                       tuple(info.get("std", ())),
                       int(info["num_classes"]), tuple(info["classes"]) if info.get("classes") else None,
                       kind=info["kind"], vocabulary=int(info.get("vocabulary", 0)), text=info.get("text"))
        c, s = int(info["channels"]), int(info["image_size"])
        empty = (torch.zeros(0, c, s, s, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64))
        classes = tuple(info["classes"]) if info.get("classes") else None
        return cls(name, empty, empty, empty, tuple(info["mean"]), tuple(info["std"]), int(info["num_classes"]),
                   classes)

    def to(self, device: torch.device, inputs_on_host: bool = False) -> Splits:
        """Move every tensor once (the whole dataset lives on the GPU where there is one); `inputs_on_host`
        (--host-data): the inputs held in memory stay there, delivered a batch at a time (source.HostRows)."""
        from .source import HostRows, read_on_demand

        def inputs(x: Any) -> Any:
            if not inputs_on_host or read_on_demand(x):  # (a file's rows stay in their file)
                return x.to(device)
            if not isinstance(x, torch.Tensor):
                raise UserError("--host-data keeps inputs held as one tensor on the host; these are named columns "
                                "(a Hugging Face batch's), which go to the device whole: leave --host-data out")
            return HostRows(x, device)

        move = lambda p: (inputs(p[0]), p[1].to(device))  # noqa: E731
        return replace(self, train=move(self.train), val=move(self.val), test=move(self.test))

    def bytes_in_memory(self) -> int:
        """What moving the splits to a device whole takes there: the tensors held in memory (a memory map's
        rows stay in their file)."""
        parts = [t for pair in (self.train, self.val, self.test) for t in pair]
        return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))


def hold_out(name: str, train: Pair, test: Pair, val_size: int, mean, std) -> Splits:
    """The classic tutorials' split: the first `val_size` training examples validate, the rest train."""
    x, y = train
    return Splits(name, (x[val_size:], y[val_size:]), (x[:val_size], y[:val_size]), test, tuple(mean),
                  tuple(std))
