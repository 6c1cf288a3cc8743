"""The ConvNet of the classic multi-GPU MNIST example (conv 64-256-512, dense 2048-1024), 28x28 inputs.

The example's dense layers had no activation (two stacked linear maps collapse into one); ReLU is
added after each so that they earn their parameters.
"""

from torch import nn


class ConvNet(nn.Sequential):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: float = 0.25) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 64, 5), nn.ReLU(), nn.MaxPool2d(2),  # 28 -> 24 -> 12
            nn.Conv2d(64, 256, 3), nn.ReLU(),  # 12 -> 10
            nn.Conv2d(256, 512, 3), nn.ReLU(), nn.MaxPool2d(2),  # 10 -> 8 -> 4
            nn.Flatten(),
            nn.Linear(512 * 4 * 4, 2048), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(2048, 1024), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(1024, num_classes),
        )
