"""The user's own network, optimizer and loss: checked once in this process before any worker starts, and
described for the run's record.

A factory that raises, a network that fails on the data's images or returns the wrong shape, an optimizer
factory that fails: each is one line that names the line of the user's code that failed, here, rather
than a traceback in every worker followed by a hint about restarts that cannot help.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..core.errors import UserError
from ..core.import_path import is_hf_folder, is_import_path
from ..core.tracebacks import failed, name_of
from ..optimization.losses import FUNCTIONS, loss_name


def check_and_describe(parts: Any, cfg: Any, data: Any, speaks: bool = True) -> dict[str, Any]:
    """Build the user's network (once, on the CPU), run it on two training images as training prepares
    them, and build the optimizer over it. Returns what will run, in words, for config's companion record.
    `speaks`: this process prints notes (rank 0; torchrun starts every rank through the same checks)."""
    from .build import make_batch_transforms, make_model
    from .initial import weights_on_meta

    record: dict[str, Any] = {}
    # a Hugging Face folder's model with nothing of the user's to run on it: built as a check of its config alone, on
    # the meta device (no memory: it may be larger than this process can hold)
    shapes_only = is_hf_folder(cfg.model) and parts.model is parts.optimizer is parts.loss is None
    try:
        with weights_on_meta() if shapes_only else contextlib.nullcontext():
            net = make_model(cfg, data, parts)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's code may raise anything)
        raise failed(f"your model factory {name_of(parts.model)} failed", e) from None
    if parts.model is not None and not isinstance(net, nn.Module):
        raise UserError(f"your model factory {name_of(parts.model)} returned a {type(net).__name__}, not an "
                        "nn.Module")
    if parts.model is not None:
        record["model"] = name_of(parts.model)
    # a registry model with the default loss needs no check
    if parts.model is not None or is_import_path(cfg.model) or parts.loss is not None:
        _check_forward(net, cfg, data, make_batch_transforms, loss=parts.loss, speaks=speaks)
    if parts.optimizer is not None:
        try:
            optimizer = parts.optimizer(net.parameters())
        except Exception as e:  # noqa: BLE001
            raise failed(f"your optimizer factory {name_of(parts.optimizer)} failed", e) from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"your optimizer factory {name_of(parts.optimizer)} returned a "
                            f"{type(optimizer).__name__}, not a torch.optim.Optimizer")
        record["optimizer"] = describe_optimizer(optimizer)
    name = loss_name(cfg, data.categorical, data.labelled)
    default = "the network's own loss" if name == "model" else name_of(FUNCTIONS[name])  # mse_loss, cross_entropy
    record["loss"] = name_of(parts.loss) if parts.loss is not None else \
        f"{default} (paratrain's {'default' if cfg.loss == 'auto' else '--loss'})"
    return record


def check_task(cfg: Any, data: Any, loss: Any) -> None:
    """Targets that are not class indices: token ids (integers, a row an example) take the cross-entropy
    (auto's), float targets the losses that compare numbers; label smoothing smooths classes and tokens
    (runplan.make asks, for every run on tensors)."""
    if data.classification:
        return
    if cfg.label_smoothing and not data.sequence:
        raise UserError(f"label_smoothing smooths class targets; these targets are {data.train[1].dtype} of shape "
                        f"{data.target_shape} an example: leave it at 0")
    if cfg.loss == "model" and not data.labelled:
        raise UserError("--loss model trains by the loss your network returns from the labels it is given, and "
                        "this data gives it none: give named columns with 'labels' (input_ids, attention_mask, "
                        "labels), or leave --loss out")
    if loss is None and data.sequence and cfg.loss not in ("auto", "cross-entropy", "model"):
        raise UserError(f"--loss {cfg.loss} compares numbers, and these targets are integers of shape "
                        f"{data.target_shape} an example (token ids): leave --loss out for the cross-entropy over "
                        "every token, give float targets" + (" (--loss bce: 0/1 labels as floats)"
                                                             if cfg.loss == "bce" else "") +
                        ", or pass a loss of your own (paratrain.fit(..., loss=...))")


def _check_forward(net: nn.Module, cfg: Any, data: Any, make_batch_transforms: Any, loss: Any,
                   speaks: bool) -> None:
    """Two training images through the network, as training prepares them: it must give a row per image,
    and (for the accuracy, and the default cross-entropy) a score for every class the labels hold; a loss of
    the user's must take that output and the two labels and give one float."""
    if any(p.device.type != "cpu" for p in net.parameters()):  # a factory that picks its device: left to the run
        return
    noun = "images" if data.images else "examples"
    x = make_batch_transforms(cfg, data, torch.device("cpu")).eval(data.train[0][:2])
    n = len(data.train[1][:2])  # the inputs may be named columns (a dict)
    net.eval()  # no BatchNorm statistics or dropout draws spent on the check
    try:
        with torch.no_grad():
            out = net(x)
    except Exception as e:  # noqa: BLE001
        raise failed(f"your network failed on 2 training {noun} of shape {data.input_shape}", e) from None
    rows = isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == n
    if loss is None and loss_name(cfg, data.categorical, data.labelled) == "model" and \
            getattr(getattr(net, "_paratrain_last", None), "loss", None) is None:
        raise UserError(f"--loss model trains by the loss your network returns, and {type(net).__name__} returned "
                        "none for 2 examples with labels: return it (a Hugging Face model does, given labels), or "
                        "give the targets apart, (inputs, targets), for paratrain's cross-entropy")
    if not data.classification:
        _check_output(out, rows, n, data, loss)
    else:
        _check_scores(out, rows, noun, cfg, data, loss, speaks)
    if loss is not None:
        try:
            with torch.no_grad():
                value = loss(out.float(), data.train[1][:2])
        except Exception as e:  # noqa: BLE001
            raise failed(f"your loss {name_of(loss)} failed on the network's output for 2 training {noun}", e) \
                from None
        if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(f"your loss {name_of(loss)} returned {got}; it must return the batch mean, one float "
                            "tensor")


def _check_scores(out: Any, rows: bool, noun: str, cfg: Any, data: Any, loss: Any, speaks: bool) -> None:
    """Class targets: a score for every class the labels hold (for the accuracy and the default cross-entropy)."""
    scores = rows and out.dim() == 2 and out.shape[1] >= data.num_classes
    if not rows or not (scores or loss is not None):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"your network returned {got} for 2 {noun}; it must return N x K logits, K at "
                        f"least the {data.num_classes} classes of the data")
    if scores and out.shape[1] > data.num_classes and not cfg.quiet and speaks:  # it trains; meant?
        print(f"paratrain: note: your network gives {out.shape[1]} scores per {noun[:-1]} and the data has "
              f"{data.num_classes} classes; the other {out.shape[1] - data.num_classes} never match a label (a "
              "factory that takes num_classes is given the data's)", flush=True)


def _check_output(out: Any, rows: bool, n: int, data: Any, loss: Any) -> None:
    """Other targets: a row per example; for the default mean squared error, the targets' shape exactly (a
    N x 1 output against N targets would broadcast to N x N and train on nonsense)."""
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if not rows:
        raise UserError(f"your network returned {got} for {n} examples; it must return one row per example")
    if loss is None and data.sequence:
        if not (isinstance(out, torch.Tensor) and out.dim() == len(data.target_shape) + 2 and
                (tuple(out.shape[1:-1]) == data.target_shape or tuple(out.shape[2:]) == data.target_shape)):
            raise UserError(f"your network returned {got} for {n} examples and the targets are token ids "
                            f"{(n, *data.target_shape)}: the cross-entropy needs a score for every token of the "
                            f"vocabulary at every position, {(n, *data.target_shape, 'V')}")
        return
    if loss is None and tuple(out.shape[1:]) != data.target_shape:
        raise UserError(f"your network returned {got} for {n} examples and the targets are "
                        f"{(n, *data.target_shape)}: the default loss (mean squared error) needs the same shape; "
                        "reshape the output, or pass a loss of your own")


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class and the settings of its first parameter group, as plain values."""
    group = optimizer.param_groups[0]
    settings = {k: _plain(v) for k, v in group.items() if k != "params"}
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", **settings}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value if isinstance(value, bool | int | float | str | type(None)) else repr(value)


def settings_that_ran(optimizer: dict[str, Any]) -> dict[str, Any]:
    """The user's optimizer's lr, momentum, weight decay and Nesterov flag, for config.yaml (where it has
    them): config.yaml then records what ran, not the defaults; parts.yaml has the rest."""
    found = {}
    for name in ("lr", "momentum", "weight_decay"):
        value = optimizer.get(name)
        if isinstance(value, float | int) and not isinstance(value, bool) and value >= 0:
            found[name] = float(value)
    if isinstance(optimizer.get("nesterov"), bool):
        found["nesterov"] = optimizer["nesterov"]
    if found.get("lr") == 0:
        del found["lr"]
    return found
