"""A small BatchNorm network in the style of today's CIFAR-10 speed records (Keller Jordan's airbench94).

    a 2x2 convolution, BatchNorm and GELU (airbench's baseline; its record fixes the convolution to whiten
    the image patches, here it is learned); three groups of conv3x3 -> max-pool 2 -> BatchNorm -> GELU ->
    conv3x3 -> BatchNorm -> GELU, of widths (w, 4w, 4w) (w = 64 is airbench94's); a 3x3 max-pool to 1x1;
    a linear head scaled by 1/9.

It is an nn.Sequential of its blocks, so the pipeline strategy can cut it between them.
"""

from __future__ import annotations

import torch
from torch import nn


class Scale(nn.Module):
    """Multiplies by a constant: airbench's head divides the logits by 9, which tempers them at the start."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor:g}"


def conv_group(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(c_out), nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.GELU(),
    )


class AirNet(nn.Sequential):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64) -> None:
        whiten = 2 * in_channels * 2 * 2  # airbench: the patches' eigenvectors and their negatives
        widths = (width, 4 * width, 4 * width)
        super().__init__(
            nn.Sequential(nn.Conv2d(in_channels, whiten, 2, bias=False), nn.BatchNorm2d(whiten), nn.GELU()),  # -> 31
            conv_group(whiten, widths[0]),  # -> 15
            conv_group(widths[0], widths[1]),  # -> 7
            conv_group(widths[1], widths[2]),  # -> 3
            nn.MaxPool2d(3), nn.Flatten(),
            nn.Linear(widths[2], num_classes, bias=False), Scale(1 / 9),
        )
