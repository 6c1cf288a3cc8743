"""The small network of the original PyTorch MNIST example (conv 10-20, dropout2d, fc 320-50-10)."""

import torch
import torch.nn.functional as F
from torch import nn


class MnistNet(nn.Module):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # 28 -> 24 -> 12
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 12 -> 8 -> 4
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, self.dropout, self.training)
        return self.fc2(x)  # logits: the loss applies log-softmax
