"""An earlier release's whole-model checkpoint file (one device's or ddp's, before every layout wrote step
folders), read into the part of the model a worker of a mesh holds: its stage's layers, its tp slices, its
fsdp shards, by the whole model's names (set_model_state_dict and set_optimizer_state_dict split each whole
tensor as the worker holds it). A whole copy (ddp, the tower) reads the file as it is (base.Strategy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ...core.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

WHOLE = StateDictOptions(full_state_dict=True, strict=False)


def load_part(module: nn.Module, saved: dict, where: str, options: dict[str, Any]) -> None:
    """The weights of `module` (this worker's part) from the file's whole model; one line where they do not fit
    (files.not_fitting: the model options changed since, or another network's), as for a whole copy."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ...checkpoint import dcp
    from ...checkpoint import files as checkpoint

    shapes = {k: v.shape for k, v in get_model_state_dict(module).items()}  # a DTensor's: the whole tensor's
    held = {k: v.shape for k, v in saved["model"].items()}
    if detail := dcp.misfit(held, shapes):
        raise checkpoint.not_fitting(saved, where, options, detail)
    set_model_state_dict(module, {k: saved["model"][k] for k in shapes}, options=WHOLE)


def restore_part(module: nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict,
                 numbers: list[int], strategy: str) -> None:
    """The optimizer state and weight average of what this worker holds: the file numbers its optimizer's state
    by parameter (`numbers`: the whole model's numbers of this worker's parameters, in their order; a stage's
    half of a shared weight has the number of the model's first name)."""
    full = saved["optimizer"]
    if len(full["param_groups"]) != 1:
        raise UserError(f"this checkpoint's optimizer has several parameter groups; --strategy {strategy} cannot "
                        "read it: carry it on under its own strategy")
    mine = [n for n, _ in module.named_parameters()]
    named = dict(zip(numbers, mine, strict=True))
    state = {named[int(i)]: v for i, v in full["state"].items() if int(i) in named}
    group: dict[str, Any] = {**full["param_groups"][0], "params": mine}
    set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": [group]}, options=WHOLE)
    if ema is not None and "ema_model" in saved:  # the whole average's, "module."-named: what this worker holds
        held = dict(ema.module.state_dict())
        average = {k.removeprefix("module."): v for k, v in saved["ema_model"].items()}
        set_model_state_dict(ema.module, {k: v for k, v in average.items() if k in held}, options=WHOLE)
