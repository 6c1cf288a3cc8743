"""Model parallelism: the layers cut into K stages, a worker each, micro-batches flowing through them.
Where to cut is in cuts.py; the stage, its schedule and evaluation through it in stages.py. No worker holds
the whole model: each evaluates and checkpoints its own stage."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.errors import UserError
from ...core.tracebacks import failed
from ...features.precision import autocast_dtype
from ..mesh import elsewhere
from .base import Strategy

if TYPE_CHECKING:  # torch is imported where a worker needs it (strategies.checked calls `check` without it)
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ...data.transforms import BatchPipeline
    from ...optimization.phases import PhaseTimer
    from ...runtime.devices import Hardware
    from ...runtime.env import Environment
    from ..layout import Layout
    from .stages import Pipeline


def refuse_in_pipeline(cfg: TrainConfig) -> None:
    """What a pipeline does not do (yet), under any strategy that cuts the layers into stages: fp16's loss scaling
    (a step skipped by one stage alone), float8, channels-last activations."""
    if cfg.precision == "float8":
        raise UserError(f"--precision float8 is not available with --strategy {cfg.strategy} yet; use --strategy "
                        "ddp or fsdp, or --precision bf16")
    if cfg.precision == "16-mixed":  # a stage that overflowed would skip its step alone
        raise UserError(f"--precision 16-mixed is not available with --strategy {cfg.strategy}: fp16's loss scaling "
                        "skips the update of a stage whose gradients overflowed, and not the other stages'; use "
                        "--precision bf16")
    if cfg.memory_format == "channels_last":
        raise UserError(f"--memory-format channels_last is not available with --strategy {cfg.strategy}"
                        + (f" (--mesh {cfg.mesh}: a pipeline)" if cfg.mesh else "") + "; leave it out or use "
                        "--strategy ddp")


def check_microbatches(cfg: TrainConfig, copies: int) -> None:
    """Each copy's share of the batch cuts into --microbatches (one line where it does not)."""
    if (cfg.batch_size // copies) % cfg.microbatches:
        raise UserError(f"each pipeline's batch of {cfg.batch_size // copies} does not split into "
                        f"--microbatches {cfg.microbatches}; use a batch that is a multiple of "
                        f"{copies * cfg.microbatches}")


class PipelineStrategy(Strategy):
    name = "pipeline"
    replicated = False  # each worker holds its part: every rank writes and reads its own
    pipelined = True  # (one copy of the pipeline: the batch split cannot fail)

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
                env: Environment) -> tuple[TrainConfig, Hardware, dict[str, Any]]:
        cfg, hardware, layout = super().arrange(cfg, hardware, env)
        check_microbatches(cfg, cls.copies(cfg, hardware.workers))
        return cfg, hardware, layout

    @classmethod
    def prepare(cls, cfg: TrainConfig, data: Splits, parts: Parts | None,
                layout: Layout) -> tuple[TrainConfig, Layout]:
        from ...components.build import make_model

        return cls.staged(cfg, data, parts, make_model(cfg, data, parts), layout)

    @classmethod
    def staged(cls, cfg: TrainConfig, data: Splits, parts: Parts | None, model: nn.Module,
               layout: Layout) -> tuple[TrainConfig, Layout]:
        """A pipeline of `model` checked and its layers cut, once: the configuration records the cuts (--split),
        the layout carries them to the workers (a tp mesh with pp asks this too)."""
        cls.prepare_checks(cfg, data, model)
        cfg = cls.cut(cfg, data, parts, model)[0]
        return cfg, dataclasses.replace(layout, cuts=tuple(int(c) for c in cfg.split.split(",")))

    @staticmethod
    def prepare_checks(cfg: TrainConfig, data: Splits, model: nn.Module) -> None:
        """What a pipeline of this model and data cannot do, in one line before any process starts."""
        from torch.distributed.pipelining import ScheduleGPipe

        from ...features.batchnorm import has_batchnorm

        if not hasattr(ScheduleGPipe, "eval"):  # evaluation runs the schedule forward only
            raise UserError(f"--strategy {cfg.strategy} evaluates through the pipeline schedule's eval(), which this "
                            "torch lacks; install torch>=2.9")
        if cfg.batchnorm == "sync" and has_batchnorm(model):
            raise UserError(f"--strategy {cfg.strategy} cannot keep --batchnorm sync: a stage normalises each "
                            "micro-batch, which one device never does; pass --batchnorm local to run it so anyway, "
                            "or use --strategy ddp")

    @classmethod
    def cut(cls, cfg: TrainConfig, data: Splits, parts: Parts | None = None,
            model: nn.Module | None = None) -> tuple[TrainConfig, str]:
        """Resolve --split (auto: balance the counted cost) into cut points, once, for every worker; and the
        table that --print-split shows. `model`: the network, where the caller has built it already."""

        from ...components.build import make_model
        from .cuts import example_batch, layers_of, resolve_cuts, split_table

        example = example_batch(cfg, data, 1)
        model = layers_of(model if model is not None else make_model(cfg, data, parts), cfg.model, example)
        try:
            cuts, costs = resolve_cuts(model, cfg.split, cfg.stages, example)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (the network's own failure, on one image in evaluation mode)
            raise failed("the network failed as its layers' costs were counted (one image, evaluation mode)",
                         e) from None
        return cfg.replace(split=",".join(map(str, cuts))), split_table(model, cuts, costs)

    # ---- in each worker: its stage ----

    stage: Pipeline

    @property
    def batch_share(self) -> tuple[int, int]:
        return self.stage.place.replica, self.stage.place.replicas  # every stage of a copy sees its batch

    def build(self, model: nn.Module, data: Splits, loss: Any) -> nn.Module:

        from ...features.batchnorm import has_batchnorm
        from .cuts import example_batch, layers_of
        from .stages import Pipeline, StagePlace

        cfg, ctx = self.cfg, self.ctx
        place = StagePlace.of(self.layout.mesh, ctx.rank)
        micro = cfg.batch_size // place.replicas // cfg.microbatches
        cuts = self.layout.cuts  # resolved once before launch (prepare)
        example = example_batch(cfg, data, micro)
        layers = layers_of(model, cfg.model, example, checked=True)  # (prepare checked them)
        self.stage = Pipeline(layers, cuts, place, ctx.device, cfg.microbatches,
                              cfg.schedule, example, loss, autocast=autocast_dtype(cfg.precision),
                              accumulate=cfg.accumulate)
        self.module = self.model = self.stage.module
        if cfg.batchnorm == "local" and ctx.is_main and not cfg.quiet and has_batchnorm(model):
            print(f"paratrain: note: --strategy {cfg.strategy} with --batchnorm local: each stage normalises its "
                  "BatchNorm layers over one micro-batch, so the run does not equal one device", flush=True)
        return self.module

    def agree_buffers(self, module: nn.Module) -> None:
        """Hybrid: the copies of a stage take copy 0's buffers (each stage owns its layers' buffers)."""
        from ...features.batchnorm import broadcast_buffers

        if self.stage.place.replicas > 1:
            broadcast_buffers(module, group=self.stage.dp_group)

    def aliases(self) -> dict[str, str]:
        return self.stage.aliases

    def load(self, saved: dict) -> None:
        """This stage's layers: its part of a sharded checkpoint (base), or of a whole model's file (the stage
        names its layers as the whole model does)."""
        from ...checkpoint import files as checkpoint

        if "sharded" in saved:
            super().load(saved)
            return
        mine = self._stage_part(saved["model"])
        checkpoint.load_weights(self.module, {**saved, "model": mine}, self.cfg.resume, self.cfg.to_dict())

    def _stage_part(self, whole: dict[str, Any]) -> dict[str, Any]:
        """This stage's entries of a whole model's state dict (the stage names its layers as the whole does)."""
        names = self.stage.module.state_dict()
        return {k: v for k, v in whole.items() if k in names}

    def restore(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict) -> None:
        if "sharded" in saved:
            super().restore(optimizer, ema, saved)  # the stage's part of the weight average too
        else:
            self.stage.load_optimizer(optimizer, saved["optimizer"])
            if ema is not None and "ema_model" in saved:  # the stage's layers of the whole average
                ema.module.load_state_dict(self._stage_part(saved["ema_model"]))

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.stage.step(x, y)  # the schedule runs the backward; only the last stage has the loss

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        with timer.phase("allreduce"):  # --time-phases: the copies' average (hybrid); the schedule's is compute
            self.stage.reduce_gradients()

    def clip_grad_norm(self, max_norm: float) -> None:
        """The norm over every stage's gradients (each stage's squared norm summed over its copy's stages), each
        scaled by torch's clip_grad_norm_ rule with it (every copy's gradients are averaged already)."""
        import torch
        import torch.distributed as dist
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        parameters = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p.grad for p in self.stage.counted_here(parameters)]
        squares = get_total_norm(counted).to(self.ctx.device, torch.float32).square() \
            if counted else torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        dist.all_reduce(squares, group=self.stage.pp_group)
        clip_grads_with_norm_(parameters, max_norm, squares.sqrt())

    def evaluate_average(self, ema: AveragedModel, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline,
                         batch_size: int, loss: Any, flip: bool, meter: Any = None) -> tuple[float, float]:
        """The weight average through the schedule (a stage cannot evaluate alone)."""
        return self._evaluate_average_in_place(ema, pair, prep, batch_size, loss, flip, meter)

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, batch_size: int, loss: Any,
                 flip: bool, meter: Any = None) -> tuple[float, float]:
        """Through the schedule, forward only, in batches of a copy's training batch (the stages' shapes are
        fixed: `batch_size` does not apply); the copies share the split out."""
        from ...optimization.evaluation import totals

        return totals(self.stage.evaluate(pair, prep, loss, flip, meter), self.ctx)

    def summary(self) -> dict[str, Any]:
        cfg, cuts = self.cfg, ",".join(map(str, self.layout.cuts))
        return {**super().summary(), "pipeline": {"stages": cfg.stages, "microbatches": cfg.microbatches,
                                                  "schedule": cfg.schedule, "cuts": cuts,
                                                  "bubble": self.stage.bubble()}}
