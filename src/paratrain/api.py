"""The Python API: train, evaluate and load back a model. `paratrain train` and `eval` are clients of it.

    import paratrain
    summary = paratrain.fit(make_net, "digits", paratrain.TrainConfig(devices="2", steps=100),
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))

Spawned workers rebuild the network from `make_net` in their own process: a module-level function or class
travels by reference, a lambda or local function by value (cloudpickle). Scripts that start workers need the
`if __name__ == "__main__":` guard, as with any spawn.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import config as C
from .components.inputs import DataLike, as_splits, file_kind, is_folder
from .components.parts import Parts
from .core.errors import UserError
from .core.outputs import check_writable
from .data import Splits
from .inference.trained import check_callables, evaluate_tensors, model_name, restore, run_of, user_facing
from .optimization.metrics import check as check_metrics
from .parallel.strategies import checked
from .runtime.env import detect


def fit(model: Callable[[], nn.Module] | None = None, data: DataLike | None = None,
        config: C.TrainConfig | None = None, *,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        metrics: dict[str, Any] | None = None, cache_key: str | None = None) -> dict[str, Any] | None:
    """Train on 1..N local workers (or in torchrun's group) and return the summary that summary.json holds
    (None on torchrun ranks other than 0).

    model: a factory that builds the network, called with whichever of `channels`, `image_size` (images
        only), `num_classes`, `input_shape` and `num_outputs` (the data's) it names; or a registry name or an
        import path ("nets.py:build"), as config.model takes them (None: `config.model`).
    data: a dataset name ("digits", "mnist", "cifar10", "synthetic"), the path of an image folder (a
        sub-folder per class; train/, val/, test/ where it has them), a map-style torch Dataset of (image,
        label) pairs (decoded once into RUN_DIR/data-cache, then split as a folder is), a `Splits`, or a
        dict with "train", "val" and "test" (inputs, targets) pairs: square images N x C x H x H (uint8
        0..255 or float) with integer labels 0..K-1, or tensors of any other shape and type (a regression's
        floats, token ids and their next tokens, -100 not counted), which go to the network as they are; or
        named columns with "labels" (input_ids, ...), a network's keyword arguments, trained by its own loss.
    config: every option of `paratrain train` (devices, strategy, batch_size, steps, epochs, out, ...);
        `resume=RUN_DIR` carries that run on in its own folder, with the options in its config.yaml; the
        fields you set away from their defaults (steps=..., say) override those, as flags do for --resume
        (a field left at its default keeps the run's value).
    optimizer: a factory `params -> Optimizer` (None: `config.optimizer`, `config.lr`, ...).
    loss: `loss(outputs, targets)`, the batch mean (None: cross-entropy for class indices and token ids, the
        network's own for labelled columns, else the mean squared error); a mapping output is read by "logits".
    metrics: {"name": metric} reported beside the loss on the validation and test sets (summary["val_name"],
        ["test_name"]): torchmetrics objects (torchmetrics.MeanAbsoluteError(), F1Score(...)), computed over
        every worker's examples as over one device's; a function `fn(outputs, targets)` is taken as the batch
        mean (weighted by the batch size); or a built-in name of config.metric ("mae", "f1", ...).
    cache_key: a name for a Dataset's decoded cache, kept under `config.cache_dir` (else ~/.cache/paratrain)
        in datasets/KEY and reopened by every later run given the same key (while it holds as many images
        of the size asked); without it the cache lives in the run directory. A Dataset has no files whose
        changes paratrain could notice: give a new key when its content changes.
    Raises UserError for bad input, saying what to do (paratrain.Stopped: Ctrl-C stopped it after a checkpoint).
    """
    import multiprocessing

    from . import session
    from .parallel import launch

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # This is a spawned worker importing the user's script, which calls fit at import (no __main__ guard):
        # leave quietly, before any work; the parent sees the exit code and says what to do.
        os._exit(launch.MAIN_GUARD_EXIT)
    if config is not None and not isinstance(config, C.TrainConfig):
        raise UserError(f"config must be a paratrain.TrainConfig, not a {type(config).__name__}; "
                        "e.g. TrainConfig(steps=100)")
    check_callables(model=None if isinstance(model, str) else model, optimizer=optimizer, loss=loss)
    metrics = check_metrics(metrics)
    cfg, model, data = _fit_config(config, model, data, optimizer)
    env = detect()  # once, for this call
    cfg = _checked(cfg, config, env)
    _check_fit(cfg, data, loss, cache_key, env)
    try:
        parts = Parts(model, optimizer, loss, metrics=metrics or None)
        return session.run(cfg, lambda: as_splits(cfg.dataset if data is None else data, cfg, cache_key,
                                                  env.in_group), parts, env=env, words=in_python)
    except UserError as e:  # the run's own words name flags (--resume RUN): a Python caller passes fields
        e.args = (in_python(str(e)),)
        raise e.with_traceback(None) from None  # bad input: its message, not paratrain's insides


def _fit_config(config: C.TrainConfig | None, model: Any, data: Any,
                optimizer: Any) -> tuple[C.TrainConfig, Any, Any]:
    """fit's configuration as the caller gave it: the run carried on (resume=), and the model, optimizer and
    data as the caller gave them; the model and data as the run will take them."""
    cfg = config or C.TrainConfig()
    if isinstance(model, str):  # a registry name or an import path, as config.model takes it
        cfg, model = cfg.replace(model=model), None
    if cfg.resume:
        cfg = resumed(cfg)
    if model is not None:
        cfg = cfg.replace(model="custom")
    elif cfg.model == "custom":
        raise UserError("config.model 'custom' needs the network's factory: paratrain.fit(model=make_net, ...)")
    if optimizer is not None:
        cfg = cfg.replace(optimizer="custom")  # what config.yaml records; parts_check.describe_optimizer says which
    elif cfg.optimizer == "custom":
        raise UserError("this run was trained with an optimizer factory of yours: pass it again, "
                        "paratrain.fit(..., optimizer=make_optimizer)")
    cfg, data = _with_data(cfg, data)
    return cfg, model, data


def _checked(cfg: C.TrainConfig, config: C.TrainConfig | None, env: Any) -> C.TrainConfig:
    """fit's configuration resolved and checked as the command line's is, in the caller's words."""
    try:
        cfg = checked(C.validate(C.with_run_dir(cfg, env)))
        C.check_read(cfg, C.changed(config or C.TrainConfig()))  # what the caller set, as flags are checked
    except UserError as e:  # in the words of the TrainConfig the caller wrote, not of the flags
        raise UserError(C.in_python_words(str(e)), e.code) from None
    return cfg


def _with_data(cfg: C.TrainConfig, data: Any) -> tuple[C.TrainConfig, Any]:
    """The dataset fields for fit's `data`, and the data as the run takes it (a path as a string)."""
    if (kind := file_kind(data, cfg.dataset)) is not None:  # a table or a tensors file, read as the CLI reads it
        return cfg.replace(dataset=kind, data_dir=str(data)), str(data)
    if is_folder(data):  # a folder of class sub-folders
        return cfg.replace(dataset="imagefolder", data_dir=str(data)), str(data)
    if isinstance(data, str):
        return cfg.replace(dataset=data), data
    if data is not None:  # tensors of the user's own (or a Splits a loader returned, which keeps its name)
        return cfg.replace(dataset=data.name if isinstance(data, Splits) and data.name in C.DATASETS
                           else "custom"), data
    return cfg, data


def _check_fit(cfg: C.TrainConfig, data: Any, loss: Any, cache_key: str | None, env: Any) -> None:
    """What fit refuses before any data is read."""
    if env.is_main:
        check_writable(cfg.out, "out")  # rank 0 writes the run directory (other nodes may not see it)
    if loss is not None and cfg.label_smoothing:
        raise UserError("config.label_smoothing smooths the built-in cross-entropy, and loss= replaces it: smooth "
                        "the targets in your loss, or leave label_smoothing at 0")
    if cache_key is not None and not isinstance(data, torch.utils.data.Dataset):
        raise UserError("cache_key names the cache of a torch Dataset given as data; a folder's cache is found by "
                        "its path (and config.cache_dir), a dataset name's needs none")


def in_python(message: str) -> str:
    """A run's message for a caller of fit: `--resume RUN` becomes the TrainConfig that carries RUN on, and
    other flags the fields they set (`--batch-size` -> `batch_size`)."""
    import re

    # the advice "continue with --resume RUN" (and "carry it on with"), not a mention of the flag
    message = re.sub(r"with --resume ([^\s;,]+)", r"with paratrain.fit(..., TrainConfig(resume='\1'))", message)
    return C.in_python_words(message)


def resumed(cfg: C.TrainConfig) -> C.TrainConfig:
    """The configuration of the run in `cfg.resume` (its config.yaml), with the fields of `cfg` that differ
    from the defaults on top, as `paratrain train --resume RUN FLAGS` puts its flags (config.overlay). A
    field left at its default keeps the run's value."""
    default = C.TrainConfig()
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(default, f.name)}
    C.check_resume_out(cfg.resume, cfg.out, f"out={cfg.out!r}")
    return C.overlay(C.of_run(cfg.resume, f"resume={cfg.resume}"), changed)


@user_facing
def evaluate(run: str | Path, data: DataLike | None = None, *, model: Callable[[], nn.Module] | None = None,
             loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, dataset: str | None = None,
             data_dir: str | None = None, download: bool | None = None, accelerator: str = "auto",
             metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Test accuracy and mean loss (cross-entropy, or `loss`) of a run's last checkpoint (or a .pt file) on
    one device, and its --metric's and `metrics` (as fit takes them: test_NAME); a figure the task has not
    (accuracy without classes) is None. `data` defaults to the run's own dataset (a run on tensors of your own
    needs them again); a run of a user's network needs its factory (`model`)."""
    from .checkpoint import files as checkpoint
    from .runtime import devices

    check_callables(model=model, loss=loss)
    run = run_of(run)
    state = checkpoint.load(run)
    cfg = C.from_dict(state["config"])
    if state.get("data", {}).get("kind", "images") != "images":
        return _finite(evaluate_tensors(run, state, data, model, loss, data_dir, accelerator, check_metrics(metrics)))
    cfg, data, whole = _test_config(run, state, cfg, _as_test_pair(data), dataset, data_dir, download)
    device = devices.device_map(devices.resolve(accelerator, "1", None))[0]  # a bad --accelerator fails before any data
    splits = _test_splits(run, state, cfg, data, whole)
    return _finite(_score(run, state, cfg, splits, device, model, loss, metrics))


def _test_config(run: Path, state: dict[str, Any], cfg: C.TrainConfig, data: Any, dataset: str | None,
                 data_dir: str | None, download: bool | None) -> tuple[C.TrainConfig, Any, bool]:
    """The run's configuration set to read the test data the caller names (or the run's own), the data left
    to read, and whether it is scored whole."""
    if data is None and data_dir is not None and dataset is None and cfg.dataset == "custom":
        data = data_dir  # a folder of test images for a run on a Dataset of yours (paratrain eval --data-dir)
    # data the caller names is scored whole: not a dataset's name, nor the run's own folder (below)
    given = (data is not None and (not isinstance(data, str) or is_folder(data))) or data_dir is not None
    if data is None and cfg.dataset == "custom":  # the run's own Dataset or tensors: its held-out test split
        data = _own_test_split(run, state, cfg)
    if is_folder(data):
        dataset, data_dir, data = "imagefolder", str(data), None
    elif isinstance(data, str):
        dataset = data
    dataset = dataset or cfg.dataset
    # An image folder is decoded at the size the network was trained at; the cache goes where it would
    # for a training run on that folder, never where the checkpoint's configuration says.
    # a folder: as the run asked (the same cache); a Dataset: decoded at the trained size
    trained = state.get("data", {}).get("image_size")
    decoded = dataset in ("imagefolder", "custom")
    # the run's own folder again: its own cache (the size it asked for); any other data: the trained size
    same_folder = dataset == "imagefolder" and cfg.dataset == "imagefolder" and data_dir is not None and \
        cfg.data_dir is not None and Path(data_dir).resolve() == Path(cfg.data_dir).resolve()
    # data the caller gives is scored whole (a folder with a test/ sub-folder: that); the run's own folder
    # again: the test images it held out
    whole = given and not same_folder
    folder = {"image_size": cfg.image_size if same_folder else trained if decoded else None,
              "cache_dir": None, "test_size": (0 if whole else cfg.test_size) if decoded else None,
              "val_size": 0 if whole and decoded else cfg.val_size,
              "skip_bad_images": cfg.skip_bad_images and dataset == "imagefolder"}
    # where to read (and download) is the caller's to say, never the checkpoint's: a checkpoint may come
    # from someone else
    if dataset == "imagefolder" and data_dir is None:
        raise UserError(f"name the image folder to test on: paratrain eval {run} --data-dir DIR (Python: "
                        f"evaluate(run, DIR)); the run trained on {cfg.data_dir}, and a checkpoint's own paths are "
                        "never followed")
    cfg = C.validate(cfg.replace(dataset=dataset, data_dir=data_dir, overwrite=False, **folder,
                                 download=C.TrainConfig.download if download is None else download))
    return cfg, data, whole


def _test_splits(run: Path, state: dict[str, Any], cfg: C.TrainConfig, data: Any, whole: bool) -> Splits:
    """The test data read, normalised as in training."""
    dataset = cfg.dataset
    if isinstance(data, torch.utils.data.Dataset):  # decoded into a cache of its own, not into the run
        import tempfile

        with tempfile.TemporaryDirectory(prefix="paratrain-eval-") as tmp:
            splits = as_splits(data, cfg.replace(out=tmp, resume=None))
            # every item, in memory before tmp goes (held out nothing: all of it is in the training rows)
            splits = dataclasses.replace(splits, test=(splits.train[0][:], splits.train[1]),
                                         **{s: (getattr(splits, s)[0][:0], getattr(splits, s)[1][:0])
                                            for s in ("train", "val")})
    else:
        if dataset == "imagefolder" and "data" in state:
            _check_folder(run, state, Path(cfg.data_dir))  # before decoding it, what its listing shows
        splits = as_splits(data if data is not None and not isinstance(data, str) else cfg.dataset, cfg)
        if whole and dataset == "imagefolder" and not len(splits.test[1]):  # no test/ sub-folder: every image
            splits = dataclasses.replace(splits, test=splits.train)
    if "data" in state:  # normalise as in training, whatever training set the caller passes now
        _check_shapes(run, state, splits)
        splits = dataclasses.replace(splits, mean=tuple(state["data"]["mean"]), std=tuple(state["data"]["std"]))
    return splits


def _score(run: Path, state: dict[str, Any], cfg: C.TrainConfig, splits: Splits, device: str, model: Any,
           loss: Any, metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The run's network on the test split, on one device, judged as the run was."""
    from .components.build import make_batch_transforms, memory_format
    from .features.precision import judged_as_run
    from .optimization.evaluation import evaluate as evaluate_on
    from .optimization.metrics import Meter, for_run
    from .parallel import strategies
    from .runtime import dist

    use_ema = cfg.eval_ema and "ema_model" in state  # the run chose to be judged by its averaged weights
    net = restore(cfg, splits, state, run, model, use_ema)
    channels_last = strategies.get(cfg.strategy).channels_last  # what its layout allowed
    if memory_format(cfg, channels_last) == torch.channels_last:  # as it trained
        net.to(memory_format=torch.channels_last)
    ctx = dist.init(0, 1, device)
    splits = splits.to(ctx.device)
    chosen = for_run(cfg.metric, check_metrics(metrics), splits)
    meter = Meter(chosen, ctx.device) if chosen else None
    prep = make_batch_transforms(cfg, splits, ctx.device, channels_last)
    with judged_as_run(cfg.precision, ctx.device.type):  # judged as the run was (its autocast too)
        acc, mean_loss = evaluate_on(net.to(ctx.device), splits.test, prep, ctx,
                                     cfg.eval_batch_size, loss, cfg.test_flip, meter=meter)
    return {"test_accuracy": acc, "test_loss": mean_loss, "test_examples": len(splits.test[1]),
            **{f"test_{k}": v for k, v in (meter.values(ctx) if meter else {}).items()},
            "dataset": cfg.dataset, "model": model_name(cfg, state, model), "ema": use_ema, "step": state["step"]}


def _finite(result: dict[str, Any]) -> dict[str, Any]:
    """NaN figures (no accuracy without classes) as None, as summary.json has them."""
    return {k: None if isinstance(v, float) and v != v else v for k, v in result.items()}


def _as_test_pair(data: Any) -> Any:
    """An (images, labels) pair of tensors: all of it is the test set."""
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        images, labels = data
        return {"train": (images, labels), "val": (images[:0], labels[:0]), "test": (images, labels)}
    return data


def _own_test_split(run: str | Path, state: dict, cfg: C.TrainConfig) -> Splits:
    """The test split a run on a Dataset of the caller's held out, from the decoded copy the run kept (its
    data-cache folder, or the cache its cache_key named)."""
    from .data.dataset import reopen

    cache = state.get("data", {}).get("cache")
    splits = reopen(Path(cache), cfg.val_size, cfg.test_size) if cache else None
    if splits is None:
        where = f"its decoded copy ({cache}) is gone" if cache else "it was trained on tensors of yours"
        raise UserError(f"{run}: {where}; pass the test data: paratrain.evaluate(run, test_data) with a Dataset, "
                        "(images, labels) tensors or an image folder")
    return splits


def _check_shapes(run: str | Path, state: dict, splits: Splits) -> None:
    """The data evaluated must be what the network takes: its channels, its classes, and its image size
    where the model takes the data's (a fixed-size model gets any size padded or cropped to its own)."""
    from .models import input_size

    saved, trained_on = state["data"], state["config"].get("dataset")
    c, side, k = int(saved["channels"]), int(saved["image_size"]), int(saved["num_classes"])
    sized_by_data = input_size(state["config"].get("model", "custom"), 0) == 0
    if splits.channels != c or (sized_by_data and splits.image_size != side) or splits.num_classes > k:
        raise UserError(f"{run} was trained on {trained_on} images of {c}x{side}x{side} in {k} classes; the "
                        f"{splits.name} test images are {splits.channels}x{splits.image_size}x{splits.image_size} "
                        f"in {splits.num_classes}: evaluate it on images like those of {trained_on}")


FOLDER_PEEK = 16  # images whose headers are read before a folder is decoded for evaluation


def _check_folder(run: str | Path, state: dict, root: Path) -> None:
    """What a folder's listing and its first images' headers show cannot fit the network (more classes,
    colour for a gray network), said before any image is decoded into a cache."""
    from .data.decode import probe_many
    from .data.folder import GRAY_MODES, list_folder

    listing = list_folder(root)
    saved, trained_on = state["data"], state["config"].get("dataset")
    c, k = int(saved["channels"]), int(saved["num_classes"])
    peeked = probe_many([str(listing.root / f) for f in listing.files[:FOLDER_PEEK]])
    colour = any(isinstance(p, tuple) and p[1] not in GRAY_MODES for p in peeked)
    if len(listing.classes) > k or (c == 1 and colour):
        raise UserError(f"{run} was trained on {trained_on} images of {c} channel{'s' * (c > 1)} in {k} classes; "
                        f"{root} holds {'colour' if colour else 'gray'} images in {len(listing.classes)} classes: "
                        f"evaluate it on images like those of {trained_on}")
