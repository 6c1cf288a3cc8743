"""The ConvNet of the classic multi-GPU MNIST example (conv 64-256-512, dense 2048-1024), 28x28 inputs.

The example's dense layers had no activation (two stacked linear maps collapse into one); ReLU is
added after each so that they earn their parameters. `filters` scales the conv widths (f, 4f, 8f) and
`kernel` is the first convolution's size, so that a search can vary them.
"""

from torch import nn


class ConvNet(nn.Sequential):
    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: float = 0.25, filters: int = 64,
                 kernel: int = 5, image_size: int = 28) -> None:
        side = ((image_size - kernel + 1) // 2 - 4) // 2  # conv k, pool 2, conv 3, conv 3, pool 2
        if side < 1:
            from ..core.errors import UserError

            raise UserError(f"--kernel {kernel} leaves no image for the convnet's later layers; use 9 or less")
        super().__init__(
            nn.Conv2d(in_channels, filters, kernel), nn.ReLU(), nn.MaxPool2d(2),  # 28 -> 24 -> 12 (k=5)
            nn.Conv2d(filters, 4 * filters, 3), nn.ReLU(),  # 12 -> 10
            nn.Conv2d(4 * filters, 8 * filters, 3), nn.ReLU(), nn.MaxPool2d(2),  # 10 -> 8 -> 4
            nn.Flatten(),
            nn.Linear(8 * filters * side * side, 2048), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(2048, 1024), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(1024, num_classes),
        )
