"""Activation checkpointing (--activation-checkpointing): a block's activations are not kept for the backward but
recomputed there from its input, about one more forward for the memory that a deeper network, a longer context
or a bigger batch needs.

The blocks are the network's repeated layers: the gpt's transformer blocks, a Hugging Face model's decoder
layers, a ResNet's residual blocks (the most numerous kind of module with layers inside, among the children of an
nn.Sequential or nn.ModuleList). `full` recomputes every block, `selective` every K-th (--selective-ac K) or each
block's attention alone (--selective-ac attention: the child whose name says attention or attn).

A block keeps its class's forward under a subclass made here (the class swap FSDP2's fully_shard makes too),
so its parameters keep their names: checkpoints, tensor-parallel plans, FSDP's blocks and optimizer state by
name see the network unchanged. Recomputation is torch.utils.checkpoint's non-reentrant one, which works under
DDP, FSDP2, DTensor and a pipeline's stages. It replays the forward's randomness: torch's generators (torch
keeps their states), and paratrain's dropout masks (features/dropout.py), which are seeded by their call's
place in the forward: the recomputation draws from the places the forward drew from, so the gradients are the
ones the run without checkpointing computes (on the CPU, equal to the bit).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from ..core.errors import UserError
from .dropout import GlobalBatchDropout

_SUBCLASSES: dict[type, type] = {}  # a block's class -> its recomputed subclass (one per class)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The network's repeated blocks, in forward order (see the module's docstring); [] where it has none."""
    from ..models.gpt import shape

    if (gpt := shape(model)) is not None:
        return list(model)[1:1 + gpt["depth"]]
    kinds: dict[type, list[nn.Module]] = {}
    for container in model.modules():
        if isinstance(container, nn.Sequential | nn.ModuleList):
            for child in container.children():
                if next(child.children(), None) is not None and next(child.parameters(), None) is not None:
                    kinds.setdefault(type(child), []).append(child)
    size = lambda ms: (len(ms), sum(p.numel() for p in ms[0].parameters()))  # noqa: E731
    found = max(kinds.values(), key=size, default=[])
    return found if len(found) >= 2 else []


def chosen(model: nn.Module, mode: str, option: str) -> list[nn.Module]:
    """The modules `mode` (and --selective-ac `option`) recomputes; a UserError where the network has none."""
    if mode == "none":
        return []
    found = blocks(model)
    if not found:
        raise UserError(f"--activation-checkpointing {mode}: {type(model).__name__} has no repeated blocks to "
                        "recompute (modules with layers inside, in an nn.Sequential or nn.ModuleList, as a "
                        "transformer's or a ResNet's); leave it out for this network")
    if mode == "full":
        return found
    if option != "attention":
        return found[::int(option)]
    attentions = [_attention_of(block) for block in found]
    if None in attentions:
        raise UserError(f"--selective-ac attention: the blocks of {type(model).__name__} ({type(found[0]).__name__}) "
                        "have no child named attention or attn; give --selective-ac K (every K-th block) instead")
    return attentions


def _attention_of(block: nn.Module) -> nn.Module | None:
    return next((m for name, m in block.named_children() if "attention" in name.lower() or "attn" in name.lower()),
                None)


def apply(model: nn.Module, mode: str, option: str) -> int:
    """Make the modules `mode` chooses recompute their activations in the backward; how many."""
    modules = chosen(model, mode, option)
    for module in modules:
        module.__class__ = _recomputed(type(module))
    config = getattr(model, "config", None)
    if modules and getattr(config, "use_cache", False):
        # a Hugging Face model's key/value cache, on in training: a recomputed layer would add its keys twice, and
        # the cache would keep every layer's (transformers' own checkpointing turns it off too)
        config.use_cache = False
    return len(modules)


def _recomputed(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
                return cls.forward(self, *args, **kwargs)
            replay = partial(_replaying, self, GlobalBatchDropout.current)
            return checkpoint(cls.forward, self, *args, use_reentrant=False, context_fn=replay, **kwargs)

        _SUBCLASSES[cls] = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward})
    return _SUBCLASSES[cls]


def _replaying(module: nn.Module, mode: GlobalBatchDropout | None) -> tuple[Any, Any]:
    """torch.utils.checkpoint's pair of contexts, made as the forward runs: none around the forward; around the
    recomputation, the dropout mode put back where the forward's calls drew from, then where it was (a
    pipeline's stage has placed other chunks between a chunk's forward and its backward), and the BatchNorm
    layers' running statistics kept as the forward left them (recomputed, they would count the batch twice)."""
    forward_at = mode.snapshot() if mode is not None else None
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]

    @contextlib.contextmanager
    def recomputing() -> Any:
        statistics = [[b.clone() for b in m.buffers()] for m in norms]
        now = mode.snapshot() if mode is not None else None
        with contextlib.ExitStack() as stack:
            if mode is not None:
                mode.restore(forward_at)
                stack.callback(mode.restore, now)
                # the backward runs without the forward's torch function modes: the mode is entered again for it
                # (as torch's TorchFunctionMode, leaving GlobalBatchDropout.current as it is)
                if mode not in _active_modes():
                    TorchFunctionMode.__enter__(mode)
                    stack.callback(TorchFunctionMode.__exit__, mode, None, None, None)
            try:
                yield
            finally:
                with torch.no_grad():
                    for m, kept in zip(norms, statistics, strict=True):
                        for b, k in zip(m.buffers(), kept, strict=True):
                            b.copy_(k)

    return contextlib.nullcontext(), recomputing()


def _active_modes() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()
