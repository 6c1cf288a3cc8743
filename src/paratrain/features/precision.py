"""--precision: the dtype a run's forward autocasts to, and the autocast itself (every layout's forward, a
pipeline's stages, tensor parallelism's loss)."""

from __future__ import annotations

import contextlib
from typing import Any

# --precision -> autocast dtype (float8: the linear layers' products in float8, the rest autocast to bf16)
AUTOCAST = {"32": None, "bf16": "bfloat16", "16-mixed": "float16", "float8": "bfloat16"}


def autocast_dtype(precision: str) -> Any:
    """The torch dtype --precision autocasts to; None for 32."""
    import torch

    return getattr(torch, AUTOCAST[precision]) if AUTOCAST[precision] else None


def autocast(device_type: str, dtype: Any) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` (autocast_dtype's) on `device_type`; nothing where it is None."""
    import torch

    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
