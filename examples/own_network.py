"""Train a network of your own with paratrain's Python API, data-parallel on 2 workers.

    python examples/own_network.py

The network is a plain nn.Module that paratrain never saw before; the optimizer comes from a lambda. The
embedded digits need no download; pass "mnist" (or a dict of your own tensors) instead.
"""

from __future__ import annotations

import torch
from torch import nn

import paratrain


class SmallCNN(nn.Sequential):
    """Two convolutions and a linear layer for 1 x 28 x 28 images (a sequence of layers, so the pipeline
    strategies could cut it too)."""

    def __init__(self) -> None:
        super().__init__(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


def main(devices: str = "2", steps: int = 20, out: str = "runs/own-network") -> dict:
    config = paratrain.TrainConfig(devices=devices, steps=steps, batch_size=64, out=out, quiet=True,
                                   tensorboard=False, overwrite=True)  # a second try replaces the first
    return paratrain.fit(SmallCNN, "digits", config,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9))


if __name__ == "__main__":  # spawned workers import this file again: train only when it is run
    summary = main(steps=300)
    print(f"{summary['model']} on {summary['world_size']} workers: test accuracy {summary['test_accuracy']:.3f} "
          f"after {summary['steps']} steps -> {summary['run_dir']}")
    # The trained network, with the preparation of its inputs: new images go in as they come (uint8
    # tensors, PIL images, image files), class indices come out.
    from paratrain.data import load_dataset

    classifier = paratrain.load_classifier(summary["run_dir"], model=SmallCNN)
    images, labels = load_dataset("digits").test  # uint8 N x 1 x 28 x 28
    print("predicted", classifier.predict(images[:8]).tolist(), "true", labels[:8].tolist())
