"""--strategy pipeline and hybrid: the meshes pp=K (a worker per stage) and dp=R,pp=K (R copies of a K-stage
pipeline, each stage's gradients averaged over its copies). What runs them in the workers is the one
composition of every mesh (composed.py: the stage, its schedule, evaluation through it); this is the names'
rules before launch (--stages, the workers they take). What a pipeline refuses and its cut: pp.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import UserError
from ..mesh import elsewhere
from .composed import Composed
from .pp import check_microbatches, refuse_in_pipeline

if TYPE_CHECKING:
    from ...config import TrainConfig
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout


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
