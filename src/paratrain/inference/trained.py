"""A run's trained network, loaded back from its checkpoint: `load_model`, `load_classifier`, and what
`paratrain.evaluate` builds on (the network of a checkpoint, the factories checked)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import config as C
from ..components.inputs import load_for
from ..components.parts import Parts
from ..core.errors import NeedsFactory, NeedsNoFactory, UserError
from ..data import Splits
from .predictor import Classifier, Predictor


def user_facing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input to a function of the API raises its one-line UserError without paratrain's frames (as fit
    does): the message says what to do, the caller's line is the last frame shown."""
    import functools

    @functools.wraps(fn)
    def called(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise e.with_traceback(None) from None

    return called


def check_callables(**given: Any) -> None:
    """model= and optimizer= take factories (every worker builds its own), loss= a function."""
    for name, value in given.items():
        if value is None:
            continue
        if name == "model" and isinstance(value, nn.Module):
            kind = type(value).__name__
            raise UserError(f"model= takes a factory that builds the network, such as its class: pass {kind}, not "
                            f"{kind}() (every worker builds its own copy)")
        if name == "optimizer" and isinstance(value, torch.optim.Optimizer):
            raise UserError("optimizer= takes a factory of the parameters, such as lambda params: "
                            f"torch.optim.{type(value).__name__}(params, lr=...), not a built optimizer")
        if not callable(value):
            raise UserError(f"{name}= must be callable (a class or a function), not a {type(value).__name__}")


def model_name(cfg: C.TrainConfig, state: dict, model: Callable[[], nn.Module] | None) -> str:
    """The model as the run's summary names it: the registry's name, or the class of the user's network."""
    from ..core.tracebacks import name_of

    if cfg.model != "custom":
        return cfg.model
    return (state.get("parts") or {}).get("model") or (name_of(model) if model is not None else "custom")


def run_of(run: Any) -> str | Path:
    """A run's folder or checkpoint file, also given as the summary fit returned."""
    if isinstance(run, dict) and "run_dir" in run:
        return run["run_dir"]
    if not isinstance(run, str | os.PathLike):
        raise UserError(f"run must be a run's folder (or a .pt file, or the summary fit returned), not a "
                        f"{type(run).__name__}")
    return run


@user_facing
def load_model(run: str | Path, model: Callable[[], nn.Module] | None = None, ema: bool = False) -> nn.Module:
    """The trained network of a run (its last checkpoint) or of a .pt file, on the CPU, in eval mode.
    A run of a user's network needs its factory; `ema`: the averaged weights (runs with --ema).
    It takes normalised inputs: `load_classifier` gives it with the transform of its training images."""
    from ..checkpoint import files as checkpoint

    check_callables(model=model)
    run = run_of(run)
    state = checkpoint.load(run)
    return loaded(run, state, model, ema)[0]


@user_facing
def load_classifier(run: str | Path, model: Callable[[], nn.Module] | None = None,
                    ema: bool | None = None) -> Classifier:
    """A run's trained network with its input preparation: `predict(images)` takes images as they come
    (uint8 tensors, PIL images, NumPy arrays) and returns class indices (probabilities on request);
    `transform(images)` gives the normalised batch the network takes. `ema`: the averaged weights (None:
    as the run was judged, --eval-ema)."""
    from ..checkpoint import files as checkpoint
    from ..components.build import make_batch_transforms
    from .predictor import CLASS_NAMES, Classifier

    check_callables(model=model)
    run = run_of(run)
    state = checkpoint.load(run)
    use_ema = bool(state["config"].get("eval_ema")) and "ema_model" in state if ema is None else ema
    net, cfg, splits = loaded(run, state, model, use_ema)
    if splits is None:
        raise UserError(f"checkpoint {run} predates the record of its data's normalisation; evaluate it with "
                        "paratrain.evaluate(run, data, model=...)")
    if not splits.images:
        raise UserError(f"{run} was trained on tensors, not images: paratrain.load_predictor(run"
                        + (", model=...)" if cfg.model == "custom" else ")") + " predicts from inputs like its data's")
    pipeline = make_batch_transforms(cfg, splits, torch.device("cpu"))
    pipeline.memory_format = torch.contiguous_format  # transform() hands users batches in the usual layout
    names = list(splits.classes) if splits.classes else CLASS_NAMES.get(cfg.dataset)
    return Classifier(net, pipeline, splits.channels, splits.image_size, names, flip=cfg.test_flip)


@user_facing
def load_predictor(run: str | Path, model: Callable[[], nn.Module] | None = None,
                   ema: bool | None = None) -> Classifier | Predictor:
    """A run's trained network with its input preparation: a Classifier for a run on images, a Predictor
    for one on tensors (`predict(inputs)`: class indices, or the network's outputs for a regression)."""
    from ..checkpoint import files as checkpoint
    from ..components.build import make_batch_transforms
    from .predictor import Predictor

    check_callables(model=model)
    run = run_of(run)
    state = checkpoint.load(run)
    if state.get("data", {}).get("kind", "images") == "images":
        return load_classifier(run, model, ema)
    use_ema = bool(state["config"].get("eval_ema")) and "ema_model" in state if ema is None else ema
    net, cfg, splits = loaded(run, state, model, use_ema)
    return Predictor(net, make_batch_transforms(cfg, splits, torch.device("cpu")), splits.input_shape,
                     splits.train[0].is_floating_point(), splits.num_classes, splits.classes, splits.vocabulary)


def loaded(run: str | Path, state: dict, model: Callable[[], nn.Module] | None,
            ema: bool) -> tuple[nn.Module, C.TrainConfig, Splits | None]:
    """A checkpoint's network in eval mode, its configuration, and splits of its data's shapes (None for
    a network of the user's in a checkpoint older than those records)."""
    cfg = C.from_dict(state["config"])
    if ema and "ema_model" not in state:
        raise UserError(f"checkpoint {run} has no averaged weights; it was trained without --ema")
    if "data" in state:  # the shapes and normalisation the model was built for, saved beside it
        splits = Splits.shaped_like(cfg.dataset, state["data"])
    else:  # a checkpoint from before they were saved: ask the dataset (a network of the user's needs none)
        splits = None if cfg.model == "custom" else load_for(C.validate(cfg.replace(data_dir=None, download=False)))
    return restore(cfg, splits, state, run, model, ema).eval(), cfg, splits


def restore(cfg: C.TrainConfig, splits: Splits | None, state: dict, run: str | Path,
             model: Callable[[], nn.Module] | None, ema: bool) -> nn.Module:
    from ..checkpoint import files as checkpoint
    from ..components.build import make_model

    if cfg.model == "custom" and model is None:
        raise NeedsFactory(run)
    if model is not None and splits is None:  # a checkpoint older than the record of its data's shapes
        net = model()
    else:
        net = make_model(cfg, splits, Parts(model) if model is not None else None)
    try:
        checkpoint.load_weights(net, {**state, "model": state["ema_model"]} if ema else state, run)
    except UserError:
        if model is None or cfg.model == "custom":
            raise
        from ..core.tracebacks import name_of  # the factory given is what does not fit: name it, not the checkpoint's

        raise NeedsNoFactory(run, cfg.model, name_of(model)) from None
    return net


def evaluate_tensors(run: str | Path, state: dict, data: Any, model: Callable[[], nn.Module] | None, loss: Any,
                     data_dir: str | None, accelerator: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """paratrain.evaluate of a run on tensors, on one device: tensors given (an (inputs, targets) pair: all of
    it; a dict: its test split), or a file (`data` a path, or --data-dir): the run's own file again gives
    the test rows the run held out; another file its x_test, or every row where it has none. The loss is
    `loss`, else cross-entropy for class indices and the mean squared error otherwise; the metrics are the
    run's --metric."""
    from ..features.precision import judged_as_run
    from ..optimization.evaluation import evaluate as evaluate_on
    from ..optimization.losses import evaluation_loss
    from ..optimization.metrics import Meter, for_run
    from ..parallel import strategies
    from ..runtime import devices, dist

    cfg = C.from_dict(state["config"])
    own = (state.get("parts") or {}).get("loss", "paratrain's")
    if loss is None and "paratrain's" not in own:
        raise UserError(f"{run} was trained with a loss of yours ({own}): pass it again, paratrain.evaluate(run, "
                        "data, loss=...), to judge it as the run was judged")
    splits, rows = _test_rows(run, cfg, state["data"], data, data_dir)
    if splits.classification and not int(state["data"]["num_classes"]):  # a --loss mse run on whole numbers
        from ..data.tensors import as_numbers

        splits = as_numbers(splits)
    _check_tensors(run, state["data"], splits)
    use_ema = cfg.eval_ema and "ema_model" in state
    shaped = Splits.shaped_like(cfg.dataset, state["data"])
    net = restore(cfg, shaped, state, run, model, use_ema).eval()
    device = devices.device_map(devices.resolve(accelerator, "1", None))[0]
    ctx = dist.init(0, 1, device)
    # the run's classes, and the targets given (0/1 labels, say)
    metrics = for_run(cfg.metric, given, dataclasses.replace(shaped, train=splits.test))
    meter = Meter(metrics, ctx.device) if metrics else None
    judge = loss if loss is not None else evaluation_loss(cfg, shaped.categorical)  # as the run was judged
    from ..components.build import (
        make_batch_transforms,  # the run's (its --standardize statistics, from the checkpoint)
    )

    with judged_as_run(cfg.precision, ctx.device.type):  # its autocast too
        acc, mean_loss = evaluate_on(net.to(ctx.device), splits.to(ctx.device).test,
                                     make_batch_transforms(cfg, shaped, ctx.device,
                                                           strategies.get(cfg.strategy).channels_last), ctx,
                                     cfg.eval_batch_size, judge, meter=meter)
    packed = (splits.text or {}).get("packed") or {}  # --pack: the test windows hold more examples than rows
    return {"test_accuracy": acc, "test_loss": mean_loss,
            "test_examples": packed.get("test_examples") or len(splits.test[1]), "rows": rows,
            **{f"test_{k}": v for k, v in (meter.values(ctx) if meter else {}).items()},
            **(_language_figures(mean_loss, splits) if judge is None and splits.sequence else {}),
            "dataset": cfg.dataset, "kind": "tensors", "model": model_name(cfg, state, model), "ema": use_ema,
            "step": state["step"]}


def _language_figures(loss: float, splits: Splits) -> dict[str, float]:
    """A language model's test perplexity, and its bits per byte where the text's bytes a token are known (the
    built-in cross-entropy over the tokens), as the run's summary gives them."""
    from ..optimization.losses import perplexity

    per_byte = ((splits.text or {}).get("bytes_per_token") or {}).get("test")
    return {"test_perplexity": perplexity(loss),
            **({"test_bits_per_byte": loss / math.log(2) / per_byte} if per_byte else {})}


def _test_rows(run: str | Path, cfg: C.TrainConfig, saved: dict, data: Any, data_dir: str | None) -> tuple[Splits, str]:
    """The test split `data` (or --data-dir) names, and which rows it is, in words."""
    from ..components.inputs import file_kind
    from ..data import tables
    from ..data.tensors import tensor_splits

    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        data = {"test": tuple(data)}
    if isinstance(data, dict):  # its test split; every example of a pair
        if "test" not in data:
            raise UserError("data has no 'test' pair: give paratrain.evaluate(run, (inputs, targets)), or a dict "
                            "with 'test'")
        test = tuple(data["test"])
        return tensor_splits({"train": test, "val": tuple(t[:0] for t in test), "test": test}), "the tensors given"
    path = data if isinstance(data, str | os.PathLike) else data_dir
    if cfg.dataset == "text":  # the text's held-out windows, cut as the run cut them (its context, tokenizer)
        if path is None:
            raise UserError(f"name the text to test on: paratrain eval {run} --data-dir FILE (Python: evaluate(run, "
                            f"FILE)); the run trained on {cfg.data_dir}, and a checkpoint's own paths are never "
                            "followed")
        from ..data import text

        return text.load(str(path), cfg.context, cfg.tokenizer, cfg.val_size, cfg.test_size, cfg.cache_dir), \
            "the text's test windows"
    if cfg.dataset == "jsonl":  # the examples held out as the run held them out (its context, tokenizer, columns)
        if path is None:
            raise UserError(f"name the examples to test on: paratrain eval {run} --data-dir FILE (Python: "
                            f"evaluate(run, FILE)); the run trained on {cfg.data_dir}, and a checkpoint's own paths "
                            "are never followed")
        from ..data import instructions

        own = cfg.data_dir is not None and Path(path).expanduser().resolve() == Path(cfg.data_dir).resolve()
        return instructions.load(str(path), cfg.context, cfg.tokenizer, cfg.val_size, cfg.test_size, cfg.columns,
                                 hold_out=own, pack=cfg.pack), \
            "the examples' test split" if own else f"every example of {Path(path).name} (not the run's own file)"
    if path is not None:
        kind = file_kind(path, cfg.dataset if cfg.dataset in ("tensors", "csv") else "tensors")
        # the file the run held its test rows out of (the same path, or a copy of the same size): those rows
        # again; another file: its x_test, or every row
        held, where = saved.get("held_out_of"), Path(path).expanduser()
        own_path = cfg.data_dir is not None and where.resolve() == Path(cfg.data_dir).resolve()
        same = own_path or (held is not None and where.exists() and
                            tables.fingerprint(where) == held.get("fingerprint"))
        splits = tables.load_csv(where, cfg.target, cfg.val_size, cfg.test_size, same) if kind == "csv" else \
            tables.load_tensors(where, cfg.val_size, cfg.test_size, same)
        if same and held is not None and (splits.origin or {}).get("rows") != held["rows"]:
            raise UserError(f"{path} holds {(splits.origin or {}).get('rows')} rows, and the run held its test rows "
                            f"out of {held['rows']}: which rows it trained on is no longer known; evaluate on a file "
                            "of test rows (x_test and y_test), or the run's file as it was")
        return splits, ("the test rows the run held out" if same else "every row" if splits.split == tables.EVERY_ROW
                        else "its x_test")
    if cfg.dataset in ("diabetes", "tokens"):  # the bundled datasets: the test rows the run held out
        return load_for(C.validate(cfg.replace(overwrite=False))), "the test rows the run held out"
    if cfg.dataset in ("tensors", "csv"):
        raise UserError(f"name the file to test on: paratrain eval {run} --data-dir FILE (Python: evaluate(run, "
                        f"FILE)); the run trained on {cfg.data_dir}, and a checkpoint's own paths are never followed")
    raise UserError(f"{run} was trained on tensors of yours: pass the test tensors, paratrain.evaluate(run, "
                    "(inputs, targets))")


def _check_tensors(run: str | Path, saved: dict, splits: Splits) -> None:
    """The tensors evaluated must be what the network takes: one example's shape, the targets', and no class
    the network has no score for."""
    want = (tuple(saved["input_shape"]), tuple(saved["target_shape"]))
    got = (splits.input_shape, splits.target_shape)
    classes, vocabulary = int(saved["num_classes"]), int(saved.get("vocabulary", 0))
    if vocabulary and splits.vocabulary > vocabulary:
        raise UserError(f"{run} was trained on token ids 0..{vocabulary - 1}; these reach {splits.vocabulary - 1}, "
                        "past its embedding: evaluate it on ids it knows")
    if got != want or splits.num_classes > classes or (classes == 0) != (splits.num_classes == 0):
        raise UserError(f"{run} was trained on inputs of {want[0]} and targets of {want[1]} an example"
                        + (f" in {classes} classes" if classes else " (numbers)")
                        + f"; these are {got[0]} and {got[1]}" + (f" in {splits.num_classes} classes"
                                                                 if splits.num_classes else " (numbers)")
                        + ": evaluate it on data like its own")
