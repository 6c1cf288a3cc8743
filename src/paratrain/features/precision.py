"""--precision: the dtype a run's forward autocasts to, and the autocast itself (every layout's forward, a
pipeline's stages, tensor parallelism's loss)."""

from __future__ import annotations

import contextlib
from typing import Any

# --precision -> autocast dtype (float8: the linear layers' products in float8, the rest autocast to bf16; tf32:
# no autocast, float32 whose matrix products round their inputs to TF32 on the tensor cores)
AUTOCAST = {"32": None, "tf32": None, "bf16": "bfloat16", "16-mixed": "float16", "float8": "bfloat16"}


def autocast_dtype(precision: str) -> Any:
    """The torch dtype --precision autocasts to; None for 32."""
    import torch

    return getattr(torch, AUTOCAST[precision]) if AUTOCAST[precision] else None


def autocast(device_type: str, dtype: Any) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` (autocast_dtype's) on `device_type`; nothing where it is None."""
    import torch

    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def judged_as_run(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast a run's evaluation ran under, for judging its checkpoint again (`paratrain eval`,
    paratrain.evaluate) as the run judged it; on a CPU, what a run computes there (runtime/devices.ON_CPU)."""
    from ..runtime.devices import ON_CPU

    if device_type == "cpu":
        precision = ON_CPU.get(precision, precision)
    return autocast(device_type, autocast_dtype(precision))


@contextlib.contextmanager
def float32_math(precision: str) -> Any:
    """Within it, float32 matrix products and cuDNN convolutions on a GPU's TF32 tensor cores where `precision`
    is tf32; otherwise torch's defaults (its float32 matrix products in full float32, its cuDNN convolutions
    allowed TF32). What the process had is put back after (fit() may run again in it). torch's older API, the one
    inductor reads (its newer fp32_precision settings, once set, make inductor's reading of it raise)."""
    import torch

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    if precision == "tf32":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
