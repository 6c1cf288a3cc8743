"""--precision float8: torchao's float8 training (as torchtitan uses it). Each linear layer whose sizes the float8
matrix product takes (multiples of 16) computes its forward and backward products in float8, scaled per tensor
from its current values (dynamic scaling); everything else runs under bf16 autocast (the strategy's). The
layers keep their parameters, their names and their float32 master weights: the optimizer, the checkpoints and
a later run in another precision see the same network. runtime/devices.check_float8 admits only GPUs of compute
capability 8.9 or later (float8 tensor cores), with torchao installed."""

from __future__ import annotations

from torch import nn


def takes(module: nn.Module, fqn: str) -> bool:
    """Whether the linear layer `module` computes in float8: its sizes multiples of 16 (what float8 matrix
    products take)."""
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module) -> None:
    """Swap the model's linear layers that `takes` for torchao's Float8Linear, in place, before any strategy wraps
    or shards them."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # padded: the weight gradient's float8 product then takes any number of tokens a micro-batch (its inner size)
    convert_to_float8_training(model, config=Float8LinearConfig(pad_inner_dim=True), module_filter_fn=takes)
