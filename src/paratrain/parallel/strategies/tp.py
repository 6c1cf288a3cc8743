"""--strategy tp: tensor parallelism alone (tp = the workers), or any --mesh that the pipeline and data-parallel
names do not cover (fsdp=2,tp=2; dp=2,tp=2,pp=2; fsdp=2,pp=2). What runs it in the workers is the one
composition of every mesh (composed.py); this is the name's rules before launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import UserError
from ..mesh import Mesh, for_run, parse
from .composed import Composed
from .pp import check_microbatches, refuse_in_pipeline

if TYPE_CHECKING:
    from ...config import TrainConfig
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout


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
