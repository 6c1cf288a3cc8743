"""The gradients clipped to a global L2 norm (--clip-grad-norm) over a mesh's workers, with torch's rule
(scale = max_norm / (norm + 1e-6), at most 1) and one total on every worker, so that every worker scales alike.
Where the gradients are held decides how the total is summed:

    one mesh of whole or fsdp-sharded copies   torch's clip_grad_norm_ (DTensors on one mesh)
    a pipeline of whole stages                 each stage's norm (fp32), squared and summed over the stages
    tensor parallelism, or fsdp in a pipeline  each held element's square (fp64) over the workers holding it

(The three agree to rounding; the matrix's clipping cells measure each against one device.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn

    from ...runtime.dist import DistContext
    from ..mesh import Mesh


def clip_grad_norm(module: nn.Module, max_norm: float, mesh: Mesh, ctx: DistContext, stage: Any = None) -> None:
    """Clip the gradients of what this worker trains (`module`; `stage`, its pipeline where pp > 1)."""
    from torch.nn.utils import clip_grad_norm_

    if mesh.pp == mesh.tp == 1:
        clip_grad_norm_(module.parameters(), max_norm)
    elif mesh.tp == mesh.fsdp == 1:
        _over_stages(module, max_norm, stage, ctx.device)
    else:
        _held(module, max_norm, mesh, ctx, stage)


def _over_stages(module: nn.Module, max_norm: float, stage: Any, device: torch.device) -> None:
    """The norm over every stage's gradients (each stage's squared norm summed over its copy's stages), each
    scaled by torch's clip_grad_norm_ rule with it (every copy's gradients are averaged already)."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    parameters = [p for p in module.parameters() if p.grad is not None]
    counted = [p.grad for p in stage.counted_here(parameters)]
    squares = get_total_norm(counted).to(device, torch.float32).square() \
        if counted else torch.zeros((), dtype=torch.float32, device=device)
    dist.all_reduce(squares, group=stage.pp_group)
    clip_grads_with_norm_(parameters, max_norm, squares.sqrt())


def _held(module: nn.Module, max_norm: float, mesh: Mesh, ctx: DistContext, stage: Any) -> None:
    """Over gradients that are DTensors (split by the plan, sharded over the copies, on several meshes) and
    plain tensors (the layers the plan leaves whole), which no one norm takes together: each worker sums the
    squares of what it holds, each divided by the workers that hold the same elements (a copy's other stages
    hold none of them); one all-reduce of those sums gives every worker the same total. (A DTensor's own norm,
    made whole over a 2-D mesh, is two all-reduces whose order may differ between ranks.)"""
    from torch.distributed.tensor import DTensor, Replicate

    stage_workers = ctx.world_size // mesh.pp
    held = [p for p in module.parameters() if p.grad is not None]
    grads = [p.grad for p in held]
    squares = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for grad in (p.grad for p in (held if mesh.pp == 1 else stage.counted_here(held))):
        if isinstance(grad, DTensor):
            on = grad.device_mesh
            holders = stage_workers // on.size() * math.prod(
                on.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate))
            grad = grad.to_local()
        else:
            holders = stage_workers
        squares += grad.double().square().sum() / holders
    if ctx.distributed:
        dist.all_reduce(squares)
    scale = min(max_norm / (math.sqrt(float(squares)) + 1e-6), 1.0)
    for grad in grads:
        grad.mul_(scale)
