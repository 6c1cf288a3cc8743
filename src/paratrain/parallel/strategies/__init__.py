"""How a model is spread over the workers: the layouts by name (--strategy), each a class of base.Strategy.
Every mesh's workers run through one composition (composed.py); the names of meshes and their rules before
launch are in names.py, the tower (one process driving several devices) in tower.py. Which examples each worker
takes of a global batch lives in data/batches.py.

The names, the composition and the pipeline's checks (names.py, composed.py, pp.py, tower.py) import no torch
at import time (the launching process checks a run without it); the rest is imported where a worker needs it.
config/fields.py lists the names (STRATEGIES) without knowing the strategies. What a layout allows or needs is
declared on its class (base.Strategy's capabilities), and asked by the code outside parallel/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import TrainConfig
    from ...data import Splits
    from .base import Strategy


def checked(cfg: TrainConfig) -> TrainConfig:
    """`cfg`, once its strategy has checked the options it cannot take (a UserError otherwise): the
    configuration's own checks (config.validate) know nothing of the strategies. A --mesh is turned into the
    strategy that runs it first (parallel/mesh.py)."""
    from ..mesh import resolved

    cfg = resolved(cfg)
    strategy = get(cfg.strategy)
    strategy.check_foreign(cfg)
    strategy.check(cfg)
    return cfg


def split_table(cfg: TrainConfig, data: Splits) -> str:
    """--print-split: the table of a pipeline's stages (each one's layers, parameters and share of the cost), for a
    layout that cuts the model into stages (--strategy pipeline or hybrid, a --mesh with pp)."""
    from ...core.errors import UserError
    from ..mesh import parse
    from .pp import cut

    stages = parse(cfg.mesh).pp if cfg.mesh else (cfg.stages or 1) if get(cfg.strategy).pipelined else 1
    if stages < 2:
        raise UserError("--print-split shows a pipeline's stages; add --strategy pipeline --stages K, or a --mesh "
                        "with pp=K")
    return cut(cfg.replace(stages=stages), data)[1]


def carried_to(cfg: TrainConfig, name: str) -> TrainConfig:
    """`cfg` (a resumed run's) to be carried on under strategy `name`: the options only its old layout took
    (those `name` does not take, and its mesh where the strategy changes) back at their defaults: an hsdp run's
    shard size does not follow it to fsdp."""
    from ...config import FIELDS
    from .base import FOREIGN

    drop = [option for option in FOREIGN if option not in get(name).options] + (["mesh"] if name != cfg.strategy
                                                                                 else [])
    return cfg.replace(**{option: FIELDS[option].default for option in drop})


def unread_options(cfg: TrainConfig) -> set[str]:
    """The options that the run of `cfg` (resolved) does not read: its model's, its layout's and its optimizer's
    unread ones, which config.yaml and the trackers' params leave out."""
    from ...config import FIELDS, READ_BY, unread
    from ...models import options_unread

    # an optimizer factory of the user's: the settings that ran are recorded (parts_check.settings_that_ran)
    optimizer = {name for name in unread(cfg, FIELDS) if getattr(cfg, READ_BY[name][0]) != "custom"}
    return {*options_unread(cfg.model), *_layout_options_unread(cfg), *optimizer}


def _layout_options_unread(cfg: TrainConfig) -> list[str]:
    """Another layout's options (FOREIGN, those its strategy does not take), a pipeline's where it has no stages,
    the tower's parameter device elsewhere, and a --mesh it does not keep."""
    from .base import FOREIGN

    strategy = get(cfg.strategy)
    unread = [option for option in FOREIGN if option not in strategy.options]
    if not strategy.pipelined and cfg.stages is None:  # a tp mesh with pp keeps its stages
        unread += ["stages", "microbatches", "schedule", "split"]
    if not strategy.one_process:
        unread.append("param_device")
    if cfg.mesh is None:
        unread.append("mesh")
    return unread


def get(name: str) -> type[Strategy]:
    """The layout class named `name`."""
    from .names import LAYOUTS

    return LAYOUTS[name]


__all__ = ["carried_to", "checked", "get", "unread_options"]
