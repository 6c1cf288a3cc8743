"""The in-memory dataset every loader returns: uint8 images and int64 labels, split three ways."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (uint8 images N x C x H x W, int64 labels N)


@dataclass(frozen=True)
class Splits:
    name: str
    train: Pair
    val: Pair  # may hold zero examples (--val-size 0)
    test: Pair
    mean: tuple[float, ...]  # per channel, on the 0..1 scale, for batch-wise normalisation
    std: tuple[float, ...]
    num_classes: int = 10

    @property
    def channels(self) -> int:
        return self.train[0].shape[1]

    @property
    def image_size(self) -> int:
        return self.train[0].shape[-1]

    def to(self, device: torch.device) -> Splits:
        """Move every tensor once (the whole dataset lives on the GPU where there is one)."""
        move = lambda p: (p[0].to(device), p[1].to(device))  # noqa: E731
        return replace(self, train=move(self.train), val=move(self.val), test=move(self.test))


def hold_out(name: str, train: Pair, test: Pair, val_size: int, mean, std) -> Splits:
    """The classic tutorials' split: the first `val_size` training examples validate, the rest train."""
    x, y = train
    return Splits(name, (x[val_size:], y[val_size:]), (x[:val_size], y[:val_size]), test, tuple(mean),
                  tuple(std))
