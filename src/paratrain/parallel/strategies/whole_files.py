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


def load_part(module: nn.Module, saved: dict, where: str) -> None:
    """The weights of `module` (this worker's part) from the file's whole model; one line where the file lacks
    one of them (another model's)."""
    names = dict(module.named_parameters()) | dict(module.named_buffers())
    mine = {k: v for k, v in saved["model"].items() if k in names}  # a stage's part of the whole model
    missing = [n for n in module.state_dict() if n not in mine]
    if missing:
        raise UserError(f"the checkpoint in {where} has no {missing[0]} (and {len(missing) - 1} more of this "
                        "worker's tensors): it is another model's; start a new run, or resume with the options of "
                        "the run that wrote it")
    set_model_state_dict(module, mine, options=WHOLE)


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
