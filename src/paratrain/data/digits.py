"""The handwritten digits scikit-learn bundles (1,797 8x8 images, shipped in this package), drawn MNIST-style
into 28x28.

Offline and small: the default dataset, so that `paratrain train` works on a fresh machine.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .bundled import packaged
from .splits import Splits, hold_out

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # fixed, so the test set never depends on the training seed


def _arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 in 0..16, labels), from the copy shipped in the package (data/files/digits.npz: the
    values scikit-learn's load_digits gives, read with numpy, without scikit-learn)."""
    arrays = packaged("digits")
    return arrays["images"].astype(np.float64), arrays["labels"].astype(np.int64)


def load(val_size: int | None) -> Splits:
    raw_images, raw_labels = _arrays()
    # float64 throughout, and statistics from exact integer sums: the images and their mean and std must not
    # depend on the thread count (a float32 sum over 1M pixels did, by a last bit, so one process's run
    # differed from another's by 1e-4 after 60 Adam steps)
    images = torch.as_tensor(raw_images, dtype=torch.float64).unsqueeze(1) / 16.0  # N,1,8,8 in [0,1]
    labels = torch.as_tensor(raw_labels, dtype=torch.int64)
    # MNIST centres a 20x20 digit in a 28x28 box: do the same, once, for the whole set.
    images = F.interpolate(images, size=(20, 20), mode="bilinear", align_corners=False)
    images = F.pad(images, (4, 4, 4, 4))
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    # The file is ordered by writer; shuffle once so train/val/test share the same writers' mix.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    images, labels = images[order], labels[order]
    n_test = int(len(labels) * TEST_FRACTION)
    test = (images[:n_test], labels[:n_test])
    train = (images[n_test:], labels[n_test:])
    val = 144 if val_size is None else val_size
    pixels = train[0][val:].long()
    n, total, squares = pixels.numel(), int(pixels.sum()), int((pixels * pixels).sum())  # exact integers
    mean = total / n / 255
    std = math.sqrt((squares - total * total / n) / (n - 1)) / 255
    return hold_out("digits", train, test, val, [mean], [std])
