"""Two small datasets that need no download, for tasks other than images: `diabetes`, a regression on a real
table shipped in the package (Efron et al.'s 442 patients, 10 features, a disease progression score a year
later, as scikit-learn distributes it), and `tokens`, a sequence classification made deterministically (12
token ids from a vocabulary of 20; the class is which of tokens 1, 2 and 3 occurs most often, ties to the
lower)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .splits import Splits
from .tables import split_rows

VOCABULARY, LENGTH, TOKENS_N = 20, 12, 3000


def packaged(name: str) -> dict[str, np.ndarray]:
    """The arrays of a data file shipped inside the package (data/files/NAME.npz; PROVENANCE.md there says
    where each comes from and under which licence)."""
    from importlib import resources

    with resources.files(__package__).joinpath("files", f"{name}.npz").open("rb") as f, \
            np.load(f, allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


def diabetes(val_size: int | None, test_size: int | None) -> Splits:
    """The features are standardised with the training rows' mean and standard deviation (their scales differ
    by 100x); the target stays in its own units (25..346), so the loss and mean absolute error read in them."""
    from dataclasses import replace

    arrays = packaged("diabetes")  # the raw table: age, sex, BMI, blood pressure, six blood serum measurements
    x, y = arrays["data"], arrays["target"]
    table = {"x": torch.from_numpy(x), "y": torch.from_numpy(y)}
    splits = split_rows(table, Path("diabetes"), val_size, test_size, None)
    train = splits.train[0].double()
    mean, std = train.mean(0), train.std(0)
    scaled = {s: (((getattr(splits, s)[0] - mean) / std).float(), getattr(splits, s)[1]) for s in ("train", "val",
                                                                                                   "test")}
    return replace(splits, name="diabetes", **scaled)


def token_pairs(n: int = TOKENS_N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCABULARY, (n, LENGTH), generator=g)
    counts = torch.stack([(x == token).sum(1) for token in (1, 2, 3)], dim=1)
    return x, counts.argmax(1)  # the first of the largest: ties go to the lower class


def tokens(val_size: int | None, test_size: int | None) -> Splits:
    from dataclasses import replace

    x, y = token_pairs()
    return replace(split_rows({"x": x, "y": y}, Path("tokens"), val_size, test_size, None), name="tokens")
