"""Inputs given as named columns (a Hugging Face batch: input_ids, attention_mask, labels, ...): the rows of every
column are taken together, and a batch reaches the network as keyword arguments (components/build.py's
pre-hook turns the dict into them). The first column stands for the inputs' shape and type (input_ids:
N x T token ids), which is what the checks, the summary's tokens an example and the checkpoints' record of
the data ask of an input tensor."""

from __future__ import annotations

from typing import Any

import torch


class Columns:
    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        # integers as int64 (ids, masks), floats as float32, as tensor_splits converts a plain input
        self.columns = {k: v if isinstance(v, torch.Tensor) and v.dtype in (torch.int64, torch.float32) else
                        (v.float() if torch.as_tensor(v).is_floating_point() else torch.as_tensor(v).long())
                        for k, v in columns.items()}
        self.first = next(iter(self.columns.values()))

    @property
    def names(self) -> list[str]:
        return list(self.columns)

    def __len__(self) -> int:
        return len(self.first)

    @property
    def shape(self) -> torch.Size:
        return self.first.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.first.dtype

    def dim(self) -> int:
        return self.first.dim()

    def is_floating_point(self) -> bool:
        return self.first.is_floating_point()

    def numel(self) -> int:
        return self.first.numel()

    def min(self) -> torch.Tensor:
        return self.first.min()

    def max(self) -> torch.Tensor:
        return self.first.max()

    def __getitem__(self, idx: Any) -> dict[str, torch.Tensor]:
        """These rows of every column, as the network's keyword arguments."""
        return {k: v[idx] for k, v in self.columns.items()}

    def subset(self, rows: Any) -> Columns:
        return Columns({k: v[rows] for k, v in self.columns.items()})

    def to(self, device: torch.device | str) -> Columns:
        return Columns({k: v.to(device) for k, v in self.columns.items()})

    def __repr__(self) -> str:
        return f"Columns({', '.join(f'{k}: {tuple(v.shape)}' for k, v in self.columns.items())})"


def empty_like(record: dict[str, list]) -> Columns:
    """Columns of no rows, of a checkpoint's record of them ({name: [shape of one row, dtype]})."""
    return Columns({k: torch.zeros(0, *shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                    for k, (shape, dtype) in record.items()})
