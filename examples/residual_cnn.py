"""A small residual CNN with BatchNorm, named to paratrain by its import path:

    paratrain train --model examples/residual_cnn.py:build --dataset imagefolder --data-dir shapes

`build` gets the data's shapes by the names it takes (channels, num_classes; image_size too, if asked), so
the same file trains on grey digits or colour photos. It returns an nn.Sequential, so the pipeline
strategies can cut it between blocks.
"""

from __future__ import annotations

from torch import nn


class Residual(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the input (a 1x1 convolution where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU()

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.relu(self.body(x) + self.skip(x))


def build(channels: int, num_classes: int, width: int = 16) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        Residual(width, width),
        Residual(width, 2 * width, stride=2),
        Residual(2 * width, 4 * width, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))
