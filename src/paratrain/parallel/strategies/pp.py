"""The pipeline dimension (pp) before launch: what a pipeline refuses, whether a batch cuts into its
micro-batches, and its cut points resolved once from --split, in the launching process (the workers take
them from the plan's Layout). Every name of a mesh with pp > 1 asks these (pipeline, hybrid, a --mesh);
where the layers are cut is in cuts.py, the stage and its schedule in stages.py. No torch at import."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ...core.errors import UserError
from ...core.tracebacks import failed

if TYPE_CHECKING:
    from torch import nn

    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ..layout import Layout


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


def staged(cfg: TrainConfig, data: Splits, parts: Parts | None, model: nn.Module,
           layout: Layout) -> tuple[TrainConfig, Layout]:
    """A pipeline of `model` checked and its layers cut, once: the configuration records the cuts (--split),
    the layout carries them to the workers."""
    prepare_checks(cfg, model)
    cfg = cut(cfg, data, parts, model)[0]
    return cfg, dataclasses.replace(layout, cuts=tuple(int(c) for c in cfg.split.split(",")))


def prepare_checks(cfg: TrainConfig, model: nn.Module) -> None:
    """What a pipeline of this model cannot do, in one line before any process starts."""
    from torch.distributed.pipelining import ScheduleGPipe

    from ...features.batchnorm import has_batchnorm

    if not hasattr(ScheduleGPipe, "eval"):  # evaluation runs the schedule forward only
        raise UserError(f"--strategy {cfg.strategy} evaluates through the pipeline schedule's eval(), which this "
                        "torch lacks; install torch>=2.9")
    if cfg.batchnorm == "sync" and has_batchnorm(model):
        raise UserError(f"--strategy {cfg.strategy} cannot keep --batchnorm sync: a stage normalises each "
                        "micro-batch, which one device never does; pass --batchnorm local to run it so anyway, "
                        "or use --strategy ddp")


def cut(cfg: TrainConfig, data: Splits, parts: Parts | None = None,
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
