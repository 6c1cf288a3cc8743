"""The classic multi-GPU "tower" recipe, in one process, for comparison with DDP.

The parameters live on one parameter device. Every step, each replica device receives a fresh copy
of the weights, computes the forward pass of its contiguous slice of the global batch, and the backward
pass sends each replica's gradient back through the copy, so the gradients are summed (for a loss that
is the mean over the global batch: averaged) on the parameter device, where one optimizer step runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call

from ..errors import UserError
from .base import Strategy

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..devices import Plan


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


class TowerStrategy(Strategy):
    name = "tower"
    unit = "towers"

    @classmethod
    def plan(cls, cfg: TrainConfig, plan: Plan, under_torchrun: bool) -> tuple[TrainConfig, Plan]:
        """One process whose device is the parameter device; its replicas are the plan's devices (GPUs,
        or copies on the CPU), recorded in the config so the worker can build them."""
        from .. import devices

        cfg, plan = super().plan(cfg, plan, under_torchrun)
        if under_torchrun:
            raise UserError("--strategy tower runs in one process; start it without torchrun")
        on_cpu = plan.accelerator == "cpu" or cfg.param_device == "cpu"
        one = devices.Plan("cpu" if on_cpu else "gpu", 1, devices.usable_cores(), "none")
        return cfg.replace(accelerator=plan.accelerator, devices=str(plan.workers)), one

    def wrap(self) -> None:
        n = int(self.cfg.devices)
        gpus = self.cfg.accelerator == "gpu"
        self.model = Tower(self.module, [torch.device("cuda", i) for i in range(n)] if gpus else [self.ctx.device] * n)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "world_size": int(self.cfg.devices)}
