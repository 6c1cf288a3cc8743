"""The names --strategy takes for a mesh (ddp, fsdp, hsdp, pipeline, hybrid, tp), each a class of the one
composition (composed.py) that runs every mesh in the workers, holding only the name's rules before launch:
the options it takes, its checks, its default devices, how it splits the batch, its mesh of N workers
(parallel/mesh.py's `of`), and the capabilities it declares (base.Strategy). The tower, one process driving
several devices, is a layout of its own (tower.py).

    ddp       dp=N            whole copies, DDP (dp.py)
    fsdp      fsdp=N          sharded copies, FSDP2 (fsdp.py)
    hsdp      dp=R,fsdp=S     sharded within groups of --shard-size, whole across them
    pipeline  pp=K            a worker a stage (pp.py, stages.py)
    hybrid    pp=K,dp=R       copies of a pipeline
    tp        tp=N, --mesh    tensor parallelism (tensor_plan.py), and any mesh the others do not name
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import STRATEGIES
from ...core.errors import UserError
from ..mesh import Mesh, elsewhere, for_run, parse
from .composed import Composed
from .pp import check_microbatches, refuse_in_pipeline
from .tower import TowerStrategy

if TYPE_CHECKING:
    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout
    from .base import Strategy


class DDP(Composed):
    name = "ddp"
    replicated = True  # every worker holds the whole model (base.Strategy: rank 0 writes each step folder)
    lockstep = False
    allreduce_timed = True
    waits_measurable = True  # gradients_ready_at: its hook marks when this worker's own gradients were ready
    auto_devices = True
    channels_last = True  # a pipeline sends activations between processes, which wants the default layout


class FSDP(Composed):
    name = "fsdp"
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
                env: Environment) -> tuple[TrainConfig, Hardware, Layout]:
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
        from .fsdp import blocks

        if cfg.shard_modules:  # a misspelt name is one line before any process starts
            with torch.device("meta"):  # its names only: no memory for its weights
                blocks(make_model(cfg, data, parts), cfg.shard_modules)
        return cfg, layout


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


class PipelineStrategy(Composed):
    name = "pipeline"
    pipelined = True  # (one copy of the pipeline: the batch split cannot fail)
    lockstep = False
    # --time-phases: the copies' average (hybrid) is a phase of its own; the schedule's exchanges are compute
    allreduce_timed = True

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        if cfg.stages is None or cfg.stages < 2:
            raise UserError(f"--strategy {cfg.strategy} needs --stages K, 2 or more (the pieces the layers are "
                            "cut into)")
        refuse_in_pipeline(cfg)

    @classmethod
    def least_devices(cls, cfg: TrainConfig) -> int:
        return cfg.stages or 2  # a worker per stage

    @classmethod
    def defaults(cls, cfg: TrainConfig) -> TrainConfig:
        return cfg.replace(devices=str(cfg.stages)) if cfg.devices == "auto" else cfg  # a worker per stage

    @classmethod
    def copies(cls, cfg: TrainConfig, workers: int) -> int:
        if workers != cfg.stages:
            raise UserError(f"--strategy pipeline runs one worker per stage: --stages {cfg.stages} needs --devices "
                            f"{cfg.stages}, not {workers}; for more workers use --strategy hybrid"
                            + elsewhere(cfg, workers))
        return 1

    @classmethod
    def arrange(cls, cfg: TrainConfig, hardware: Hardware,
                env: Environment) -> tuple[TrainConfig, Hardware, Layout]:
        cfg, hardware, layout = super().arrange(cfg, hardware, env)
        check_microbatches(cfg, cls.copies(cfg, hardware.workers))
        return cfg, hardware, layout


class Hybrid(PipelineStrategy):
    name = "hybrid"
    unit = "pipeline copies"

    @classmethod
    def defaults(cls, cfg: TrainConfig) -> TrainConfig:
        return cfg  # --devices auto: every device, in copies of the pipeline

    @classmethod
    def copies(cls, cfg: TrainConfig, workers: int) -> int:
        k = cfg.stages
        if workers % k:
            raise UserError(f"--strategy hybrid needs a worker count that --stages {k} divides; {workers} is not; "
                            f"use --devices {k * max(1, workers // k)}")
        return workers // k


class TensorParallel(Composed):
    name = "tp"
    unit = "copies"
    allreduce_timed = False  # the collectives run inside the forward and backward (--time-phases: compute)
    options = ("tp_plan",)

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        mesh = parse(cfg.mesh) if cfg.mesh else None
        if cfg.stages is not None and (mesh is None or mesh.pp != cfg.stages):
            raise UserError("--stages is for --strategy pipeline or hybrid; with tensor parallelism give the stages "
                            "as pp in --mesh (e.g. --mesh tp=2,pp=2)")
        super().check(cfg.replace(stages=None))  # the stages are the mesh's pp
        if cfg.precision in ("16-mixed", "float8"):
            raise UserError(f"--precision {cfg.precision} is not available with --strategy tp (a mesh with tensor "
                            "parallelism) yet; leave it out or use --strategy fsdp")
        if mesh is not None and mesh.pp > 1:
            refuse_in_pipeline(cfg)

    @classmethod
    def defaults(cls, cfg: TrainConfig) -> TrainConfig:
        if cfg.devices == "auto" and not cfg.mesh:  # tp over every device would cross nodes, or not divide
            raise UserError("--strategy tp needs --devices N (the tensor-parallel workers, within one node) or "
                            "--mesh (e.g. --mesh dp=2,tp=2)")
        return cfg

    @classmethod
    def copies(cls, cfg: TrainConfig, workers: int) -> int:
        return for_run(cfg, workers).copies

    @classmethod
    def arrange(cls, cfg: TrainConfig, hardware: Hardware,
                env: Environment) -> tuple[TrainConfig, Hardware, Layout]:
        cfg, hardware, layout = super().arrange(cfg, hardware, env)
        mesh = layout.mesh
        if mesh.pp > 1:
            check_microbatches(cfg, mesh.copies)
        # config.yaml records the workers counted (tp = --devices where no --mesh is given)
        cfg = cfg.replace(stages=mesh.pp if mesh.pp > 1 else None, devices=str(hardware.workers))
        return cfg, hardware, layout

    @classmethod
    def mesh_of(cls, cfg: TrainConfig, workers: int, env: Environment) -> Mesh:
        return for_run(cfg, workers)


# Every layout by its name, in config.STRATEGIES's order (the flag's choices, which config lists without knowing
# the layouts): a new one is a class above and its name there.
LAYOUTS: dict[str, type[Strategy]] = {c.name: c for c in (DDP, TowerStrategy, PipelineStrategy, Hybrid, FSDP, HSDP,
                                                          TensorParallel)}
assert tuple(LAYOUTS) == STRATEGIES, "config.STRATEGIES names the layouts of names.LAYOUTS, in order"
