"""A language model's training FLOPs a token, for tokens/s -> FLOP/s and the model FLOPs utilisation (MFU), as
PaLM (Chowdhury et al. 2022, appendix B) and nanoGPT count them: 6N for the matrix multiplies of the forward
and backward passes over N weights that multiply (every weight but the token and position lookups; a head
tied to the token embedding multiplies, so it counts), plus 12 x layers x width x context for the attention's
scores and weighted sums (their whole square, as the convention counts it: a causal kernel skips half).
Where the network's layers are not known (a network of the user's that is no Hugging Face transformer), the
attention is not counted, and the figure says so."""

from __future__ import annotations

from typing import Any

from torch import nn


def flops_per_token(model: nn.Module, context: int) -> tuple[float, str]:
    """(FLOPs a trained token costs, how they were counted) for `model` reading `context` tokens a sequence."""
    weights = _multiplying(model)
    shape = _shape(model)
    if shape is None:
        return 6.0 * weights, "6N (attention not counted: layers unknown)"
    depth, width = shape
    return 6.0 * weights + 12.0 * depth * width * context, "6N + 12 x layers x width x context"


def _multiplying(model: nn.Module) -> int:
    """The weights that multiply: all but the embedding tables' (which are looked up), except a table that is
    also the output head's weight (tied, as GPT-2's is)."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # a tied weight once
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) not in lookups or id(p) in heads:
            total += p.numel()
    tied = _tied_head(model)
    return total + (tied.numel() if tied is not None and id(tied) not in heads else 0)


def _tied_head(model: nn.Module) -> Any:
    """A Hugging Face model's output embedding where it is the input embedding (tied): it multiplies."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return None
    try:
        source, head = get_in(), get_out()
    except Exception:  # noqa: BLE001 (a model without them raises NotImplementedError)
        return None
    if source is not None and head is not None and head.weight is source.weight:
        return head.weight
    return None


def _shape(model: nn.Module) -> tuple[int, int] | None:
    """(layers, width) of the built-in gpt, or of a Hugging Face transformer by its config."""
    from .gpt import shape

    ours = shape(model)
    if ours is not None:
        return ours["depth"], ours["width"]
    config = getattr(model, "config", None)
    depth = _first(config, ("num_hidden_layers", "n_layer", "num_layers"))
    width = _first(config, ("hidden_size", "n_embd", "d_model"))
    return (depth, width) if depth and width else None


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
