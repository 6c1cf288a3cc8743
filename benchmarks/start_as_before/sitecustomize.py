"""Started with this folder on PYTHONPATH (benchmarks/reference_runs.py --start-as-before), every paratrain process
builds its model whole from the seed and draws the initial weights as releases before the meta-device build did
(the gpt: torch's default draws of each layer as it was made, then GPT-2's normal draws, then the residual
branches' last layers again): so a run of today's code that starts from the weights of before can be compared
with the hashes of a run of before, and shows that what the steps compute is unchanged."""

from __future__ import annotations

import math

import torch
from torch import nn

import paratrain.components.build as build
from paratrain.models.gpt import GPT, INIT_STD


def _as_before(model: GPT, seed: int) -> None:
    """The weights the gpt of before drew from `seed`, in the order it drew them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():  # each layer as it was made (the modules in the order they were made)
            if isinstance(module, nn.Linear):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)

        def redrawn(module: nn.Module) -> None:
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=INIT_STD)

        model.apply(redrawn)
        depth = len(model) - 3
        for block in list(model)[1:1 + depth]:
            for layer in (block.attention.out, block.mlp.down):
                nn.init.normal_(layer.weight, std=INIT_STD / math.sqrt(2 * depth))


def make_empty(cfg, data, parts):  # noqa: ANN001, ANN201 (build.make_empty's own signature)
    torch.manual_seed(cfg.seed)
    model = build.make_model(cfg, data, parts)
    if isinstance(model, GPT):
        _as_before(model, cfg.seed)
    return model, None, "its weights are drawn as before (benchmarks/start_as_before)"


build.make_empty = make_empty
