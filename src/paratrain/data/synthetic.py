"""Random images and labels of a chosen shape: for throughput measurements, not for accuracy."""

from __future__ import annotations

import torch

from .splits import Splits

TRAIN, VAL, TEST = 20_000, 1_000, 2_000


def load(channels: int, size: int, val_size: int | None, seed: int = 0) -> Splits:
    g = torch.Generator().manual_seed(seed)
    n_val = VAL if val_size is None else val_size

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=g)
        return x, torch.randint(0, 10, (n,), generator=g)

    return Splits("synthetic", make(TRAIN), make(n_val), make(TEST), (0.5,) * channels, (0.29,) * channels)
