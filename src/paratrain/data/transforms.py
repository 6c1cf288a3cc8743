"""Batch-wise input preparation on the batch's device: no per-sample Python on the hot path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Normalize:
    """uint8 N x C x H x W -> float, normalised per channel, padded or centre-cropped to `size`."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], size: int,
                 device: torch.device) -> None:
        self.scale = (1.0 / (255.0 * torch.tensor(std, device=device))).view(1, -1, 1, 1)
        self.shift = (torch.tensor(mean, device=device) / torch.tensor(std, device=device)).view(1, -1, 1, 1)
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        side = x.shape[-1]
        if side < self.size:  # e.g. MNIST 28 -> LeNet-5's 32: pad raw zeros, as the tutorials do
            p = (self.size - side) // 2
            x = F.pad(x, (p, self.size - side - p, p, self.size - side - p))
        elif side > self.size:  # e.g. CIFAR 32 -> 24: the evaluation-time centre crop
            o = (side - self.size) // 2
            x = x[..., o: o + self.size, o: o + self.size]
        return x.float() * self.scale - self.shift
