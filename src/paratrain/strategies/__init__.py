"""How a model is spread over the workers. Data sharding itself lives in data/sharding.py."""

from .ddp import unwrap, wrap

__all__ = ["unwrap", "wrap"]
