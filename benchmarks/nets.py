"""Networks of the benchmarks that paratrain does not ship, given as a user gives one (--model FILE.py:FACTORY)."""

from __future__ import annotations

from torch import nn


def resnet18() -> nn.Module:
    """torchvision's ResNet-18 for 10 classes, as a new user trained it on CIFAR-10 (issue 35)."""
    import torchvision

    return torchvision.models.resnet18(num_classes=10)
