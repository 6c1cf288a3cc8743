"""Sharded data parallelism (FSDP2): every worker holds 1/N of each weight, its gradient and its optimizer
state; a block's weights are all-gathered just before it runs and its gradients reduce-scattered after.

`fully_shard` wraps each block (--shard-modules, or the model's top-level children that hold weights), then
the whole model, on a CPU or GPU DeviceMesh (a CPU mesh is asked for by name: on a machine with CUDA, FSDP2
would otherwise pick a CUDA mesh under a gloo group). hsdp shards within groups of --shard-size workers and
replicates across the groups (a 2-D mesh: the layout for several nodes). Checkpoints go through
torch.distributed.checkpoint (checkpoint/dcp.py): each rank writes its own shards, and a later run of any worker
count reads them into its own (the worker count may change on resume). The EMA is a second sharded
copy, made before the model is sharded (FSDP modules cannot be deep-copied). Evaluation runs the sharded
model itself, in lock-step (every forward is a collective).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.errors import UserError
from .base import Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout
    from ..mesh import Mesh


def blocks(model: nn.Module, names: str | None) -> list[nn.Module]:
    """The modules sharded one at a time: those named in `names` (comma-separated module names), a decoder's
    stage's blocks (its forward calls its pieces, not its top-level children: the rest is the root's), or the
    model's top-level children that hold weights (the registry's models are built as a row of blocks)."""
    if names:
        found = dict(model.named_modules())
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for name in wanted:
            if name not in found or name == "":
                top = ", ".join(n for n, _ in model.named_children())
                raise UserError(f"--shard-modules names '{name}', which this network does not have; its "
                                f"top-level modules are: {top}")
        return [found[n] for n in wanted]
    from .decoder import stage_blocks

    decoder = stage_blocks(model)
    if decoder is not None:
        return decoder
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_units(model: nn.Module, names: str | None) -> list[nn.Module | list[nn.Module]]:
    """The blocks as FSDP2 shards them, one group each: blocks that share a weight (GPT-2's embedding, in its
    body, and its head) together in one group, as FSDP2 requires of a shared weight."""
    units: list[list[nn.Module]] = []
    for block in blocks(model, names):
        mine = {id(p) for p in block.parameters()}
        sharing = [u for u in units if any(id(p) in mine for m in u for p in m.parameters())]
        merged = [m for u in sharing for m in u] + [block]
        units = [u for u in units if u not in sharing] + [merged]
    return [u[0] if len(u) == 1 else u for u in units]


class FSDP(Strategy):
    name = "fsdp"
    replicated = False  # each worker holds its part: every rank writes and reads its own
    lockstep = True  # every forward is a collective: every worker runs as many (evaluation.evaluate)
    allreduce_timed = False  # the reduce-scatter runs inside the backward (--time-phases: compute)
    options = ("shard_modules", "reshard_after_forward", "cpu_offload")
    reads_whole_files = False  # its workers read their shards of a sharded (DCP) checkpoint only

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.precision == "16-mixed":
            raise UserError(f"--precision 16-mixed is not available with --strategy {cfg.strategy} (FSDP casts "
                            "the weights itself); use --precision bf16")
        if cfg.shard_size is not None and cfg.shard_size < 1:
            raise UserError(f"--shard-size {cfg.shard_size}: give a positive number of workers")

    @classmethod
    def arrange(cls, cfg: TrainConfig, hardware: Hardware,
                env: Environment) -> tuple[TrainConfig, Hardware, dict[str, Any]]:
        cfg, hardware, layout = super().arrange(cfg, hardware, env)
        if cfg.cpu_offload and hardware.accelerator != "gpu":
            raise UserError("--cpu-offload moves the shards off the GPUs; on the CPU they are there already: "
                            "leave it out")
        if cfg.cpu_offload and hardware.workers == 1:
            raise UserError("--cpu-offload keeps fsdp's shards in CPU memory; one worker trains the whole model "
                            "unsharded: use 2 or more --devices, or leave it out")
        return cfg, hardware, layout

    @classmethod
    def prepare(cls, cfg: TrainConfig, data: Splits, parts: Parts | None,
                layout: Layout) -> tuple[TrainConfig, Layout]:
        import torch

        from ...components.build import make_model

        if cfg.shard_modules:  # a misspelt name is one line before any process starts
            with torch.device("meta"):  # its names only: no memory for its weights
                blocks(make_model(cfg, data, parts), cfg.shard_modules)
        return cfg, layout

    # ---- in each worker ----

    def build(self, model: nn.Module, data: Splits, loss: Any) -> nn.Module:
        """The model, sharded (on 2 or more workers; one trains the plain module): each block's weights cut
        into this worker's share, which fully_shard moves to the mesh's device (a GPU holds its shard, never
        the whole model; with --cpu-offload the shard stays in CPU memory). The whole model is built first, on
        the CPU, so every worker count starts from the one device's initial weights: it takes 4 bytes a weight
        there until it is sharded."""
        from ...features.batchnorm import has_batchnorm, synchronise

        self.loss = loss
        module = model if self.ctx.distributed else model.to(self.ctx.device)
        if self.ctx.distributed and self.cfg.batchnorm == "sync" and has_batchnorm(module):
            module = synchronise(module, self.ctx.device)  # over the global batch, as one device would
        # the EMA's copy, unsharded: FSDP's modules refuse deepcopy (average() shards it like the model)
        self._unsharded = copy.deepcopy(module) if self.cfg.ema else None
        self._shard(module)
        self.module = self.model = module
        return module

    def _mesh(self) -> Any:
        """The run's mesh (dp x fsdp: its copies, each sharded), as parallel/mesh.py builds every strategy's."""
        from ..mesh import data_mesh, device_mesh

        return data_mesh(self.layout.mesh, device_mesh(self.layout.mesh, self.ctx.device.type))

    def _shard(self, module: nn.Module) -> None:
        """fully_shard each block, then the root (one worker: nothing to shard, the plain module trains)."""
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if not self.ctx.distributed:
            return
        if not hasattr(self, "mesh"):
            self.mesh = self._mesh()
        options: dict[str, Any] = {"mesh": self.mesh}
        if self.cfg.precision in ("bf16", "float8"):  # weights gathered in bf16, gradients reduced in fp32
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.cfg.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for unit in shard_units(module, self.cfg.shard_modules):
            fully_shard(unit, reshard_after_forward=self.cfg.reshard_after_forward, **options)
        # the root's own weights are needed again at once by the backward: never freed after its forward
        fully_shard(module, reshard_after_forward=False, **options)

    def compiled_units(self) -> list[nn.Module]:
        """Each block sharded on its own (its hooks gather and free its weights, outside the compiled code); the
        root's own forward, which runs them one after the other, stays eager. One worker: the plain model."""
        return blocks(self.module, self.cfg.shard_modules) if self.ctx.distributed else [self.module]

    def average(self, decay: float) -> AveragedModel:
        unsharded, self._unsharded = self._unsharded, None
        return self._average_sharded(unsharded, decay, self._shard)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # sharded, FSDP's policy casts the gathered weights; one worker trains the plain module under autocast
        return contextlib.nullcontext() if self.ctx.distributed else super()._autocast()

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.ctx.distributed:  # --accumulate: gradients reduce-scattered only in the last micro-batch
            self.module.set_requires_gradient_sync(sync)
        return super().forward_backward(x, y, sync, backward)

    # ---- checkpoints: sharded (base's _save_sharded; every strategy reads them) ----

    def load(self, saved: dict) -> None:
        if "sharded" not in saved:
            written = saved["config"].get("strategy", "ddp")
            raise UserError(f"the checkpoint in {self.cfg.resume or self.cfg.out} holds one whole-model file (an "
                            f"earlier release's --strategy {written}), which --strategy {self.cfg.strategy} does not "
                            "read; carry it on with ddp, tower or pipeline, or start a new run under --strategy "
                            f"{self.cfg.strategy}")
        super().load(saved)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "strategy": self.name}


class HSDP(FSDP):
    name = "hsdp"
    options = ("shard_modules", "reshard_after_forward", "cpu_offload", "shard_size")

    @classmethod
    def mesh_of(cls, cfg: TrainConfig, workers: int, env: Environment) -> Mesh:
        """dp=copies, fsdp=shard size: each tensor sharded over --shard-size workers (default: one node's), whole
        in each of workers / shard size groups."""
        from ..mesh import Mesh

        size = cfg.shard_size or (env.local_world_size if env.in_group else workers)
        if workers % size:
            given = f"--shard-size {size}" if cfg.shard_size else f"the default shard size, {size} (a node's workers)"
            raise UserError(f"{given} does not divide the {workers} workers; pass --shard-size with a divisor of "
                            f"{workers} (the workers of one node, say)")
        return Mesh(dp=workers // size, fsdp=size)
