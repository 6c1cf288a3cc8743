"""Data x pipeline parallelism: R = N/K copies of a K-stage pipeline on a 2-D DeviceMesh (dp x pp); each
stage's gradients are averaged over its R copies (stages.Pipeline.reduce_gradients)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import UserError
from .pipeline import PipelineStrategy

if TYPE_CHECKING:
    from ...config import TrainConfig


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
