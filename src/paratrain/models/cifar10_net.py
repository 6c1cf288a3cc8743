"""The network of the classic TensorFlow CIFAR-10 multi-GPU tutorial, on 24x24 crops.

conv 5x5 64, max-pool 3x3/2, LRN, conv 5x5 64, LRN, max-pool 3x3/2, fc 384, fc 192, fc 10.
TensorFlow's lrn(depth_radius=4, bias=1, alpha=0.001/9, beta=0.75) sums over 2*4+1 = 9 channels
and does not divide by the window, PyTorch's LocalResponseNorm does: so size=9, alpha=0.001.
BandedLRN computes nn.LocalResponseNorm's function four times faster on CPUs (see layers.py).
"""

from torch import nn

from .layers import BandedLRN


def _lrn() -> BandedLRN:
    return BandedLRN(64, size=9, alpha=0.001, beta=0.75, k=1.0)


class Cifar10Net(nn.Sequential):
    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 64, 5, padding=2), nn.ReLU(),
            nn.MaxPool2d(3, 2, padding=1), _lrn(),  # 24 -> 12
            nn.Conv2d(64, 64, 5, padding=2), nn.ReLU(), _lrn(),
            nn.MaxPool2d(3, 2, padding=1),  # 12 -> 6
            nn.Flatten(),
            nn.Linear(64 * 6 * 6, 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(),
            nn.Linear(192, num_classes),
        )
