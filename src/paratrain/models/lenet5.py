"""LeNet-5 (LeCun et al. 1998) with today's ReLU and max-pooling, on 32x32 inputs."""

from torch import nn


class LeNet5(nn.Sequential):
    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),  # 32 -> 28 -> 14
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),  # 14 -> 10 -> 5
            nn.Flatten(),
            nn.Linear(400, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )
