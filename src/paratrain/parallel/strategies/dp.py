"""The dp dimension of whole copies (--strategy ddp, the mesh dp=N): every worker holds the whole model and
torch's DistributedDataParallel averages the gradients in the backward. The composition (composed.py) wraps
whole copies with `wrap` once their state is restored. (Copies that are sharded, or split by tensor
parallelism, are FSDP2's: fsdp.py; a pipeline's copies are averaged by the pipeline: stages.py.)"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ...runtime.dist import DistContext


def _buffer_sync_flag() -> str:
    """DDP's option that broadcasts rank 0's buffers before every forward: torch 2.14 renamed
    broadcast_buffers to forward_sync_buffers; the older releases that pyproject allows know only the first."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


class LastBucket:
    """When this worker's last bucket of gradients was ready to be all-reduced (its own backward done)."""

    ready: float | None = None


def _timed_allreduce(last, bucket):  # noqa: ANN001, ANN202 (DDP refuses a hook annotated otherwise than with its types)
    """DDP's all-reduce (the mean over the workers), noting when the last bucket was handed to it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if bucket.is_last():
        last.ready = time.perf_counter()
    return allreduce_hook(None, bucket)


def wrap(module: nn.Module, ctx: DistContext, synced_bn: bool) -> tuple[Any, LastBucket | None]:
    """`module` in DDP, and on the CPU the mark of when its last bucket was ready (training/stragglers.py)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step.
    # Synchronised BatchNorm layers keep equal buffers on every worker: broadcasting them each step
    # would only cost time. (Under --batchnorm local DDP gives every worker rank 0's before each forward.)
    model = DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True,
                                    **{_buffer_sync_flag(): not synced_bn})
    if ctx.device.type != "cpu":  # on a GPU the host does not wait in the backward: nothing to time
        return model, None
    last = LastBucket()
    model.register_comm_hook(last, _timed_allreduce)
    return model, last
