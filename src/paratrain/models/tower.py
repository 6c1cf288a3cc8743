"""The model of the tower strategy (strategies/tower.py): the classic multi-GPU "tower" recipe, in one
process, for comparison with DDP.

The parameters live on one parameter device. Every step, each replica device receives a fresh copy
of the weights, computes the forward pass of its contiguous slice of the global batch, and the backward
pass sends each replica's gradient back through the copy, so the gradients are summed (for a loss that
is the mean over the global batch: averaged) on the parameter device, where one optimizer step runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


class Tower(nn.Module):
    def __init__(self, model: nn.Module, replica_devices: list[torch.device]) -> None:
        super().__init__()
        self.module = model  # on the parameter device; the optimizer updates these tensors
        self.replica_devices = replica_devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.replica_devices)
        if len(x) % n:
            raise ValueError(f"a batch of {len(x)} does not split evenly over {n} towers")
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        outputs = []
        for device, part in zip(self.replica_devices, x.chunk(n), strict=True):
            # .to() is differentiable: the backward pass brings each tower's gradient home and adds it up.
            weights = {k: v.to(device, non_blocking=True) for k, v in {**params, **buffers}.items()}
            outputs.append(functional_call(self.module, weights, (part.to(device, non_blocking=True),)))
        return torch.cat([o.to(x.device) for o in outputs])
