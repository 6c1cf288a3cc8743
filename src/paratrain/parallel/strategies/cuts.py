"""Where a pipeline cuts a model: the model as a sequence of layers (an nn.Sequential, a module whose forward
applies its children in order, or a Hugging Face decoder's pieces: decoder.py), each layer's counted cost, the
cut points that balance the stages, and the table --print-split shows. Pure functions of the model and an
example batch: the launching process resolves the cuts once, and the workers take them from the plan.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...core.errors import UserError


def layers_of(model: nn.Module, name: str, example: torch.Tensor, checked: bool = False) -> nn.Sequential:
    """The model as a sequence of layers: an nn.Sequential as it is; a Hugging Face decoder as its pieces
    (decoder.py: embeddings, each block, norm and head; its stages are named as the model is); another module
    whose forward is its children applied in order (checked on `example`: the same output, exactly) as an
    nn.Sequential of those children under their own names (checkpoints load back into the model). `checked`: the
    launching process has checked the decoder's pieces against it (a worker skips that)."""
    from .decoder import anatomy, pieces_of, same_output

    if isinstance(model, nn.Sequential):
        return model
    decoder = pieces_of(model, example, checked)
    if decoder is not None:
        return decoder
    if anatomy(model) is not None:
        raise UserError(f"'{name}' is laid out as a Hugging Face decoder, but its embeddings, blocks, norm and head "
                        "in order do not compute its scores (its forward does more: scales, masks or adds "
                        "something between them), so a pipeline cannot cut it; use --strategy fsdp or ddp")
    own = list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False))
    x = torch.randn(example.shape, generator=torch.Generator().manual_seed(0))  # zeros would hide a scaling
    # (a worker's model, built on the meta device, computes nothing: the launching process checked it, built whole)
    if any(True for _ in model.children()) and not own and (checked or same_output(model, _children, x)):
        return _children(model)
    raise UserError(f"a pipeline (--strategy pipeline/hybrid, pp in --mesh) needs a model that is a sequence of "
                    f"layers (lenet5, convnet, cifar10-net, mlp, gpt, an nn.Sequential, a module whose forward "
                    f"applies its children in order, or a Hugging Face decoder laid out as LlamaForCausalLM or "
                    f"GPT2LMHeadModel are); '{name}' is not one")


def stage_module(layers: nn.Sequential, lo: int, hi: int) -> nn.Module:
    """The module of the stage that holds layers lo..hi-1, its weights named as in the whole model: a decoder's
    own stage (decoder.Pieces.stage), else those children of the sequence under their own names."""
    from .decoder import Pieces

    if isinstance(layers, Pieces):
        return layers.stage(lo, hi)
    return nn.Sequential(OrderedDict(list(layers.named_children())[lo:hi]))


def whole_model(layers: nn.Sequential) -> nn.Module:
    """The model the layers were taken from (its parameters' order is a whole-model checkpoint's)."""
    return getattr(layers, "whole", layers)


def example_batch(cfg: Any, data: Any, n: int) -> torch.Tensor:
    """A batch of `n` zero examples as the first stage takes them: images at the model's input size, or the
    data's own inputs (kind "tensors"), whose shapes fix the stages' buffers."""
    if not data.images:
        return torch.zeros(n, *data.input_shape, dtype=data.train[0].dtype)
    from ...models import input_size

    side = input_size(cfg.model, data.image_size)
    return torch.zeros(n, data.channels, side, side)


def _children(model: nn.Module) -> nn.Sequential:
    return nn.Sequential(OrderedDict(model.named_children()))


# ---- where to cut (pure functions, and the counted cost they balance) ----

@torch.no_grad()
def layer_costs(model: nn.Sequential, example: torch.Tensor) -> list[float]:
    """Counted forward cost of each layer for one example: FLOPs of its matrix products and convolutions
    (FlopCounterMode) plus one operation per output element, the memory-bound part that activations,
    pooling and normalisation consist of. Counted in evaluation mode: the same operations, and a BatchNorm
    after a 1x1 feature map cannot fail on the one example's batch statistics (training mode would); the
    model's mode is put back."""
    costs, x = [], example
    was_training = model.training
    model.eval()
    try:
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                y = run_layer(layer, x)
            costs.append(float(counter.get_total_flops() + y.numel()))
            x = y
    finally:
        model.train(was_training)
    return costs


def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`; a layer built on the meta device (its weights not drawn yet) run as a copy of it on the CPU whose
    weights are zeros, for the shape and type of what it gives (its values mean nothing): a meta tensor runs no
    CPU autocast, draws no dropout mask and meets no constant a layer makes on the CPU. One layer at a time."""
    if not any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
        return layer(x)
    zeros = copy.deepcopy(layer)._apply(lambda t: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t)
    return zeros(x)


def balanced_cuts(costs: list[float], k: int) -> list[int]:
    """The k-1 cut points (the layer index where each stage after the first starts) that make the
    costliest stage as cheap as possible: the linear partition problem, solved exactly."""
    n = len(costs)
    if not 1 <= k <= n:
        raise UserError(f"--stages {k}: the model has {n} layers; use 2 to {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: the lowest possible maximum stage cost for the first i layers in j stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):  # the last stage holds layers s..i-1
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, s
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        cuts.append(i)
    return sorted(cuts)


def parse_split(spec: str, n_layers: int, k: int) -> list[int]:
    """`--split 3,5` -> [3, 5]: stage 1 is layers 0-2, stage 2 layers 3-4, stage 3 the rest."""
    try:
        cuts = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--split '{spec}': write auto or cut points such as 3,5") from None
    if len(cuts) != k - 1 or cuts != sorted(set(cuts)) or not all(0 < c < n_layers for c in cuts):
        raise UserError(f"--split '{spec}': {k} stages need {k - 1} increasing cut points between 1 and "
                        f"{n_layers - 1} (the model has {n_layers} layers; see --print-split)")
    return cuts


def stage_bounds(cuts: list[int], n_layers: int) -> list[tuple[int, int]]:
    edges = [0, *cuts, n_layers]
    return list(zip(edges[:-1], edges[1:], strict=True))


def resolve_cuts(model: nn.Sequential, split: str, k: int, example: torch.Tensor) -> tuple[list[int], list[float]]:
    costs = layer_costs(model, example)
    cuts = balanced_cuts(costs, k) if split == "auto" else parse_split(split, len(model), k)
    return cuts, costs


def split_table(model: nn.Sequential, cuts: list[int], costs: list[float]) -> str:
    """What --print-split shows: each stage's layers, parameters and share of the counted cost."""
    total = sum(costs)
    lines = [f"{'stage':<6}{'layers':<10}{'parameters':>12}{'cost (MFLOP/ex)':>17}{'share':>8}  contents"]
    for s, (lo, hi) in enumerate(stage_bounds(cuts, len(model))):
        params = sum(p.numel() for i in range(lo, hi) for p in model[i].parameters())
        cost = sum(costs[lo:hi])
        names = ", ".join(getattr(model[i], "label", type(model[i]).__name__) for i in range(lo, hi))
        lines.append(f"{s:<6}{f'{lo}-{hi - 1}':<10}{params:>12,}{cost / 1e6:>17.3f}{cost / total:>8.1%}  {names}")
    return "\n".join(lines)


def theoretical_bubble(k: int, m: int) -> float:
    return (k - 1) / (m + k - 1)
