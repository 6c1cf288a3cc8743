"""Batch-wise input preparation and augmentation on the batch's device: no per-sample Python.

Training batches may be randomly cropped, flipped and jittered (the CIFAR-10 tutorial's distortions);
validation and test batches get the deterministic centre crop (or padding) to the model's input size.
Random draws come from the generator the loop seeds per step, so they are reproducible and resumable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Augment:
    random_crop: bool = False
    crop_padding: int = 0
    hflip: bool = False
    brightness: float = 0.0  # shift in [-b, b] on the 0..1 pixel scale
    contrast: float = 0.0  # factor in [1-c, 1+c] around each image's per-channel mean

    @property
    def active(self) -> bool:
        return self.random_crop or self.hflip or self.brightness > 0 or self.contrast > 0


def fit_to_size(x: torch.Tensor, size: int) -> torch.Tensor:
    """Centre-pad (e.g. MNIST 28 -> LeNet-5's 32, with raw zeros as the tutorials do) or centre-crop
    (e.g. CIFAR 32 -> 24) square images to `size`."""
    side = x.shape[-1]
    if side < size:
        p = (size - side) // 2
        return F.pad(x, (p, size - side - p, p, size - side - p))
    if side > size:
        o = (side - size) // 2
        return x[..., o: o + size, o: o + size]
    return x


def random_crop(x: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """A `size` x `size` window at an independent random offset in every image, in one gather."""
    n, _, h, w = x.shape
    oy = torch.randint(0, h - size + 1, (n,), generator=generator, device=x.device)
    ox = torch.randint(0, w - size + 1, (n,), generator=generator, device=x.device)
    ar = torch.arange(size, device=x.device)
    rows, cols = (oy[:, None] + ar)[:, :, None], (ox[:, None] + ar)[:, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None]
    return x.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


def unit_scale(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to 0..1 floats; float images are taken as they are."""
    return x.to(torch.float32, copy=True) if x.is_floating_point() else x.float().div_(255)


class BatchPipeline:
    """uint8 N x C x H x W -> float, sized to the model, (augmented,) normalised per channel."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], size: int, device: torch.device,
                 augment: Augment | None = None, memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.inv_std = 1.0 / torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.size = size
        self.augment = augment or Augment()
        self.memory_format = memory_format  # the layout the model's convolutions take (build.memory_format)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) * self.inv_std).contiguous(memory_format=self.memory_format)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        return self._normalise(unit_scale(fit_to_size(x, self.size)))

    __call__ = eval

    def train(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        a = self.augment
        if not a.active:
            return self.eval(x)
        x = unit_scale(x)
        if a.random_crop:
            if x.shape[-1] < self.size:  # pad small images up first, as evaluation does
                x = fit_to_size(x, self.size)
            if a.crop_padding:
                x = F.pad(x, (a.crop_padding,) * 4)
            x = random_crop(x, self.size, generator)
        else:
            x = fit_to_size(x, self.size)
        n = x.shape[0]
        if a.hflip:
            flip = torch.rand(n, generator=generator, device=x.device) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if a.brightness:
            x = x + (torch.rand(n, 1, 1, 1, generator=generator, device=x.device) * 2 - 1) * a.brightness
        if a.contrast:
            factor = 1 + (torch.rand(n, 1, 1, 1, generator=generator, device=x.device) * 2 - 1) * a.contrast
            m = x.mean(dim=(2, 3), keepdim=True)
            x = (x - m) * factor + m
        return self._normalise(x)


class TensorPipeline:
    """Data that is not images (kind "tensors") goes to the network as it is: no augmentation, and no
    normalisation unless asked for (--standardize: each input element less the training split's mean, over
    its standard deviation, given as `mean` and `std` of one example's shape). The same calls as
    BatchPipeline."""

    def __init__(self, mean: torch.Tensor | None = None, std: torch.Tensor | None = None) -> None:
        self.mean, self.std = mean, std

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return x
        return (x - self.mean) / self.std

    __call__ = eval

    def train(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.eval(x)
