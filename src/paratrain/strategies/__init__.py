"""How a model is spread over the workers: one module per strategy, each a subclass of base.Strategy.
Data sharding itself lives in data/sharding.py.

The registry names each strategy's class by import path, so choosing `ddp` never imports the pipeline
machinery, and config.py can list the names without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Strategy

REGISTRY = {
    "ddp": "paratrain.strategies.ddp:DataParallel",
    "tower": "paratrain.strategies.tower:TowerStrategy",
    "pipeline": "paratrain.strategies.pipeline:PipelineStrategy",
    "hybrid": "paratrain.strategies.hybrid:Hybrid",
}


def get(name: str) -> type[Strategy]:
    """The strategy class registered as `name`."""
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["REGISTRY", "get"]
