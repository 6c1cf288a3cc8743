"""A network of the user's taken as it is: a Hugging Face model (or any network) whose forward takes keyword
arguments and returns a mapping.

- Inputs given as named columns (data/columns.py) reach it as keyword arguments: a forward pre-hook turns the
  one dict the rest of paratrain passes (DDP, FSDP, evaluation, the checks) into them.
- A mapping it returns (a ModelOutput, a dict) is read by its "logits": a forward hook gives losses, metrics
  and generation the tensor. The network stays as it is, its state_dict's names too, so that its checkpoints
  load in transformers.
- A packed batch (data/packing.py: position_ids that start again at each example) reaches a Hugging Face model
  without its key/value cache: transformers keeps packed examples apart by their position_ids only where there is
  none (masking_utils), and a training step has no use for one.
- The loss it returns from the labels it was given (a Hugging Face model's, shifted as it shifts them) is
  kept from its last forward, for --loss model (`models_loss`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..core.errors import UserError
from ..optimization.losses import counted


class LastOutputs:
    """The loss of a network's last forward (None where it returned none). Shared by a deep copy of the
    network (the EMA's), whose hooks are the same closures: evaluation reads it right after each forward."""

    loss: torch.Tensor | None = None


def read_by_logits(net: Any) -> Any:
    """`net` with the hooks above (anything that is no nn.Module passes through: the checks name it)."""
    if not isinstance(net, nn.Module):
        return net
    last = LastOutputs()

    def logits_of(module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, Mapping):
            last.loss = None
            return output
        if output.get("logits") is None:
            raise UserError(f"your network {type(module).__name__} returned a {type(output).__name__} without "
                            f"'logits' (it holds {', '.join(map(str, output.keys())) or 'nothing'}); return the "
                            "scores, or a mapping with them under 'logits'")
        last.loss = output.get("loss")
        return output["logits"]

    try:  # (a packed batch's keywords turn its cache off where its forward takes use_cache)
        net._paratrain_takes_cache = "use_cache" in inspect.signature(net.forward).parameters
    except (TypeError, ValueError):
        net._paratrain_takes_cache = False
    net.register_forward_pre_hook(_as_keywords, with_kwargs=True)
    net.register_forward_hook(logits_of)
    net._paratrain_last = last  # for models_loss
    return net


def _as_keywords(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        named = dict(args[0])
        if "position_ids" in named and getattr(module, "_paratrain_takes_cache", False):
            named["use_cache"] = False
        return (), named
    return None


def models_loss(net: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """--loss model: the loss `net` returned at its last forward, as a loss function of (logits, targets)."""
    last = getattr(net, "_paratrain_last", None)

    def own_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if last is None or last.loss is None:
            raise UserError(f"--loss model trains by the loss your network returns, and "
                            f"{type(net).__name__} returned none: give it labels (a 'labels' column), or leave "
                            "--loss out (paratrain's cross-entropy against the targets)")
        return last.loss.float()

    own_loss.__qualname__ = own_loss.__name__ = "the network's own loss"
    # a causal LM's loss is a mean over its labels from the second position on (it shifts them): the sums of
    # several batches and workers are weighed by those counts (evaluation.step_sums, losses.token_weights)
    own_loss.counts = lambda labels: counted(labels[:, 1:])  # type: ignore[attr-defined]
    return own_loss
