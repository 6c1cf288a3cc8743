"""A regression on a table of numbers: 20 float features an example, one float target, the mean squared error.

    python examples/regression.py            # 2 workers, then 1 device, on the same global batch

`make_data` builds the table (deterministic: the same numbers on every machine); `build` is the network,
given the data's shapes by the names it takes (`input_shape`, one example's; `num_outputs`, 1 here). Tensors
that are not images go to the network as they are: no normalisation, no augmentation. The targets are floats,
so the default loss is the mean squared error, and no accuracy is reported.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def make_data(n: int = 3000, features: int = 20, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A smooth non-linear function of the features plus a little noise, split 80/10/10."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, generator=g) / math.sqrt(features)
    y = torch.tanh(x @ w) + 0.5 * torch.sin(x[:, 0] * x[:, 1]) + 0.05 * torch.randn(n, generator=g)
    a, b = int(n * 0.8), int(n * 0.9)
    return {"train": (x[:a], y[:a]), "val": (x[a:b], y[a:b]), "test": (x[b:], y[b:])}


class Regressor(nn.Module):
    def __init__(self, features: int, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                  nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1)  # one number an example, the targets' shape


def build(input_shape: tuple[int, ...]) -> nn.Module:
    return Regressor(input_shape[0])


if __name__ == "__main__":
    import paratrain

    data = make_data()
    for devices in ("2", "1"):
        paratrain.fit(build, data, paratrain.TrainConfig(devices=devices, steps=300, batch_size=64, optimizer="adam",
                                                         lr=0.003, out=f"runs/regression-{devices}"))
