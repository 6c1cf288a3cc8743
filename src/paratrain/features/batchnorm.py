"""BatchNorm over the whole global batch, so that N data-parallel workers train what one device would.

Each worker of a data-parallel run sees 1/N of every global batch. A plain BatchNorm normalises with the
statistics of that share, so its gradients are not those of the global batch and the workers' running
statistics drift apart. `synchronise` replaces every BatchNorm layer (any subclass of torch's _BatchNorm)
by one that normalises with the statistics of the whole global batch: PyTorch's SyncBatchNorm on GPUs, and
`CpuSyncBatchNorm` (below) elsewhere, since PyTorch's refuses CPU tensors. The replacement shares the
layer's parameters and buffers and keeps its state_dict keys, so checkpoints load into the plain network.

`CpuSyncBatchNorm` makes one all-reduce in the forward pass (count, sum and sum of squares per channel, in
float64 so that the statistics round as one device's do) and one in the backward pass (the sums of the
output gradient and of its product with the centred input): the same scheme as PyTorch's SyncBatchNorm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    """Whether any layer of `model` is a BatchNorm (1d, 2d, 3d, SyncBatchNorm, or a subclass)."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


class _GlobalBatchNorm(torch.autograd.Function):
    """Training-mode batch normalisation with the statistics of the batch over every process of `group`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float, eps: float,
                group: Any) -> torch.Tensor:
        n = x.numel() // x.size(1)
        # this share's mean and (biased) variance, by the kernel torch's own BatchNorm uses: 3x faster here
        # than var_mean over the N, H, W dimensions
        # (it returns bf16/fp16 statistics for bf16/fp16 input, so that input goes in as float32)
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        mean, var = torch.batch_norm_update_stats(wide, None, None, 0.0)
        mean64 = mean.double()
        stats = torch.cat([mean64 * n, (var.double() + mean64 * mean64) * n, mean64.new_tensor([n])])
        dist.all_reduce(stats, group=group)
        channels = x.size(1)
        count = stats[-1]
        g_mean = stats[:channels] / count
        g_var = (stats[channels:2 * channels] / count - g_mean * g_mean).clamp_(min=0)
        if int(count) < 2:
            raise ValueError(f"BatchNorm needs more than 1 value per channel when training; the global batch "
                             f"gives {int(count)}")
        if running_mean is not None:  # as torch's batch_norm: the unbiased variance goes into the running one
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_var * count / (count - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean_f, var_f = g_mean.float(), g_var.float()
        ctx.save_for_backward(x, weight, mean_f, var_f)
        ctx.count, ctx.group, ctx.eps = float(count), group, eps
        # torch's fused kernel does the normalisation itself: in eval mode it takes the statistics it is given
        return F.batch_norm(x, mean_f, var_f, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, var = ctx.saved_tensors
        w = weight if weight is not None else torch.ones_like(mean)
        # torch's fused eval-mode backward: dy * w * invstd, and this share's sums of dy and dy * x_hat
        grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
            dy, x, w, mean, var, None, None, False, ctx.eps, [ctx.needs_input_grad[0], True, True])
        if ctx.needs_input_grad[0]:  # the same on every process (the same network), so all join the all-reduce
            invstd = torch.rsqrt(var + ctx.eps)
            sums = torch.cat([grad_b, grad_w / invstd]).double()  # sum(dy), sum(dy * (x - mean))
            dist.all_reduce(sums, group=ctx.group)
            channels = x.size(1)
            mean_dy = (sums[:channels] / ctx.count).float()
            mean_dy_xmu = (sums[channels:] / ctx.count).float()
            # one device's gradient subtracts the batch means of dy and of dy * x_hat: an affine map of x
            slope = -w * invstd ** 3 * mean_dy_xmu  # -w * invstd * x_hat * mean(dy * x_hat), per unit of x
            shift = -w * invstd * mean_dy - mean * slope
            shape = _channel_shape(x)
            exact = grad_x.float()  # bf16/fp16: the kernel's term is rounded already; the correction is not
            grad_x = exact.add_(shift.view(shape)).addcmul_(x, slope.view(shape)).to(x.dtype)
        # this process's share of the parameter gradients: DDP averages them as it does every other gradient
        if weight is None or not ctx.needs_input_grad[1]:
            grad_w = None
        if not ctx.needs_input_grad[2]:
            grad_b = None
        return grad_x, grad_w, grad_b, None, None, None, None, None


class CpuSyncBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training-mode statistics are those of the batch over every process of the
    group (gloo on CPUs); in eval mode, or on one process, it is torch's BatchNorm (which, without running
    statistics, normalises each worker's evaluation batch by itself, as torch's SyncBatchNorm does)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, group: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group = group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least a 2D input (got {x.dim()}D)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        # Only training synchronises (as torch's SyncBatchNorm): evaluation gives the workers unequal shares,
        # so a collective there would wait for batches that some workers do not have.
        if not (self.training and dist.is_initialized() and dist.get_world_size(self.group) > 1):
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:  # as _BatchNorm.forward counts and averages
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return _GlobalBatchNorm.apply(x, self.weight, self.bias, self.running_mean, self.running_var, momentum,
                                      self.eps, self.group)


def _replace(module: nn.Module, make: Any) -> nn.Module:
    """`module` with every _BatchNorm inside it replaced by make(layer), recursively."""
    if isinstance(module, _BatchNorm):
        return make(module)
    for name, child in module.named_children():
        new = _replace(child, make)
        if new is not child:
            setattr(module, name, new)
    return module


def _cpu_sync(layer: _BatchNorm, group: Any) -> CpuSyncBatchNorm:
    new = CpuSyncBatchNorm(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats,
                           group)
    # the same tensors, not copies: the optimizer, the checkpoint and the EMA see the layer they know
    new.weight, new.bias = layer.weight, layer.bias
    new.running_mean, new.running_var = layer.running_mean, layer.running_var
    new.num_batches_tracked = layer.num_batches_tracked
    new.train(layer.training)
    return new


def synchronise(model: nn.Module, device: torch.device, group: Any = None) -> nn.Module:
    """`model` (on `device`) with every BatchNorm layer normalising over the whole batch of `group`'s
    processes: torch.nn.SyncBatchNorm on GPUs, CpuSyncBatchNorm elsewhere."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    return _replace(model, lambda layer: layer if isinstance(layer, CpuSyncBatchNorm) else _cpu_sync(layer, group))


def broadcast_buffers(module: nn.Module, src: int = 0, group: Any = None) -> None:
    """Give every process of `group` the buffers (BatchNorm's running statistics) of the group's process
    `src`, so that every worker evaluates and saves the same network (collective, one per buffer: none for
    a network without buffers)."""
    for buffer in module.buffers():
        dist.broadcast(buffer, group=group, group_src=src)
