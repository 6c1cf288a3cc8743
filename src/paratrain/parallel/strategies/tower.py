"""The classic multi-GPU "tower" recipe, in one process, for comparison with DDP (the model is
models/tower.py): the parameters on one device, a replica per device fed fresh weights every step, the
gradients summed on the parameter device, one optimizer step."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ...core.errors import UserError
from .base import Strategy

if TYPE_CHECKING:
    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout


class TowerStrategy(Strategy):
    name = "tower"
    unit = "towers"
    one_process = True

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.precision == "float8":
            raise UserError("--precision float8 is not available with --strategy tower; use --strategy ddp")
        if cfg.compile:  # the classic recipe, kept as it was to be compared with
            raise UserError("--compile is not available with --strategy tower (the classic recipe, kept as it was "
                            "for comparison); use --strategy ddp")
        if cfg.activation_checkpointing != "none":  # a replica's recomputation would run on the first device's weights
            raise UserError("--activation-checkpointing is not available with --strategy tower (its replicas share "
                            "one module's weights); use --strategy ddp")

    @classmethod
    def arrange(cls, cfg: TrainConfig, hardware: Hardware,
                env: Environment) -> tuple[TrainConfig, Hardware, Layout]:
        """One process whose device is the parameter device; its replicas are the run's devices (GPUs,
        or copies on the CPU), in the layout: their places in the run's device map, until the plan names them
        (runplan.make)."""
        from ...runtime import devices

        cfg, hardware, layout = super().arrange(cfg, hardware, env)
        if env.in_group:
            raise UserError("--strategy tower runs in one process; start it without torchrun")
        on_cpu = hardware.accelerator == "cpu" or cfg.param_device == "cpu"
        # the cores its workers would have had (a search trial's share of the pool, not every core)
        threads = min(devices.usable_cores(), hardware.threads_per_worker * hardware.workers)
        one = devices.Hardware("cpu" if on_cpu else "gpu", 1, threads, "none")
        # config.yaml records the resolved devices, which a resumed run then asks for again
        return (cfg.replace(accelerator=hardware.accelerator, devices=str(hardware.workers)), one,
                dataclasses.replace(layout, replicas=tuple(map(str, range(hardware.workers)))))

    @classmethod
    def prepare(cls, cfg: TrainConfig, data: Splits, parts: Parts | None,
                layout: Layout) -> tuple[TrainConfig, Layout]:
        from ...components.build import make_model

        cls.check_network(make_model(cfg, data, parts))
        return cfg, layout

    @staticmethod
    def check_network(model: Any) -> None:
        """What the tower cannot train, in one line before any process starts."""
        from ...features.batchnorm import has_batchnorm

        # Its replicas run the layer through functional_call on copies of the buffers: on the CPU they share
        # the running statistics (updated N times a step), on GPUs the updates are lost.
        if has_batchnorm(model):
            raise UserError("--strategy tower cannot train a network with BatchNorm layers (its replicas would "
                            "update the running statistics wrongly); use --strategy ddp")

    def wrap(self) -> None:
        import torch

        from ...models.tower import Tower

        self.model = Tower(self.module, [torch.device(d) for d in self.layout.replicas])

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "world_size": len(self.layout.replicas)}
