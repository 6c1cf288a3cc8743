"""Sequence classification over token ids: 12 tokens an example from a vocabulary of 20, 3 classes, a GRU.

    python examples/sequences.py            # 2 workers, then 1 device, on the same global batch

`make_data` builds the sequences (deterministic); the class is which of tokens 1, 2 and 3 occurs most often
(ties go to the lower), so the network must read the whole sequence. The inputs are integers, so they reach
the network as they are, for its embedding; the targets are one class index an example, so cross-entropy is
the default loss and accuracy is reported.
"""

from __future__ import annotations

import torch
from torch import nn

VOCABULARY, LENGTH = 20, 12


def make_data(n: int = 3000, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCABULARY, (n, LENGTH), generator=g)
    counts = torch.stack([(x == token).sum(1) for token in (1, 2, 3)], dim=1)
    y = counts.argmax(1)  # the first of the largest: ties go to the lower class
    a, b = int(n * 0.8), int(n * 0.9)
    return {"train": (x[:a], y[:a]), "val": (x[a:b], y[a:b]), "test": (x[b:], y[b:])}


class GRUClassifier(nn.Module):
    def __init__(self, num_classes: int, vocabulary: int = VOCABULARY, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(self.embed(tokens))  # the state after the last token: 1 x N x width
        return self.head(last[0])


def build(num_classes: int) -> nn.Module:
    return GRUClassifier(num_classes)


if __name__ == "__main__":
    import paratrain

    data = make_data()
    for devices in ("2", "1"):
        paratrain.fit(build, data, paratrain.TrainConfig(devices=devices, steps=300, batch_size=64, optimizer="adam",
                                                         lr=0.01, out=f"runs/sequences-{devices}"))
