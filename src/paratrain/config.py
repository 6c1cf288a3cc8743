"""Training configuration: the single source of defaults, YAML load/save, validation.

Every field is also a `paratrain train` flag (cli/parser.py builds the flags from the field metadata), so a
value can come from the dataclass default, a YAML file, or the command line, in that order of priority.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError, closest
from .import_path import absolute, is_import_path

# custom: paratrain.fit(model=...)
MODELS = ("lenet5", "convnet", "mnist-net", "cifar10-net", "mnist-fast-net", "cifar10-fast-net", "mlp", "custom")
# imagefolder: a folder of class sub-folders (--data-dir); custom: tensors given to paratrain.fit
DATASETS = ("digits", "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "synthetic", "imagefolder", "custom")
# custom: an optimizer factory given to paratrain.fit
OPTIMIZERS = ("adam", "sgd", "gd", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "custom")
LR_SCHEDULES = ("constant", "exponential", "step", "cosine")
PRECISIONS = ("32", "bf16", "16-mixed")
ACTIVATIONS = ("relu", "elu", "tanh", "sigmoid")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
BATCHNORM = ("sync", "local")
# the parallelisms (strategies/ registers a class for each; its `check` refuses what one cannot take)
STRATEGIES = ("ddp", "tower", "pipeline", "hybrid")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class TrainConfig:
    # what to train
    model: str = _f("lenet5", "a registry model, or your network's factory: package.module:factory or "
                    "path/to/file.py:factory", choices=MODELS)
    dataset: str = _f("digits", "dataset (digits is embedded and needs no download)", choices=DATASETS)
    data_dir: str | None = _f(None, "folder with the dataset files, or where to download them")
    download: bool = _f(True, "download a missing dataset through torchvision", flag="--no-download",
                        off_help="never download: a missing dataset is an error")
    val_size: int | None = _f(None, "training examples held out for validation (default: per dataset)")
    labels: str = _f("fine", "cifar100: its 100 fine classes or its 20 coarse ones", choices=("fine", "coarse"))
    test_size: int | None = _f(None, "imagefolder without a test/ folder: images held out for testing "
                               "(default: a tenth)")
    image_size: int | None = _f(None, "imagefolder: the side images are resized and centre-cropped to "
                                "(default: the median, at most 224)")
    cache_dir: str | None = _f(None, "imagefolder: where the decoded images are cached (default: inside "
                               "--data-dir, or the user's cache folder when it is read-only)")
    skip_bad_images: bool = _f(False, "imagefolder: leave out images that cannot be decoded (counted and "
                               "listed in the cache's manifest) instead of stopping")
    # model options (used by the models that have them)
    width: int = _f(512, "mlp: neurons per hidden layer")
    depth: int = _f(2, "mlp: number of hidden layers")
    activation: str = _f("relu", "mlp: activation", choices=ACTIVATIONS)
    dropout: float | None = _f(None, "dropout probability (default: the model's own)")
    filters: int = _f(64, "convnet: filters of the first convolution (the next two have 4x and 8x); "
                      "cifar10-fast-net: of its first block (the next two have 4x)")
    kernel: int = _f(5, "convnet: kernel size of the first convolution")
    # where to run
    accelerator: str = _f("auto", "cpu, gpu, or auto (gpu when there is one)", choices=("auto", "cpu", "gpu"))
    strategy: str = _f("ddp", "ddp: a process per device; tower: one process, parameters on --param-device; "
                       "pipeline: the layers cut into --stages, a process each; hybrid: data x pipeline",
                       choices=STRATEGIES)
    param_device: str = _f("auto", "tower: where the parameters live: cpu, cuda:0, or auto (cuda:0 on GPUs)",
                           choices=("auto", "cpu", "cuda:0"))
    devices: str = _f("auto", "workers (processes): auto or a number")
    threads_per_worker: int | None = _f(None, "CPU threads per worker (default: cores / workers)")
    max_restarts: int = _f(0, "restart every worker from the last checkpoint when one dies, up to this many times")
    collective_timeout: float = _f(300.0, "seconds a collective may wait for a worker before the run ends")
    oversubscribe: bool = _f(False, "allow more CPU workers than cores (much slower; for tests)",
                             flag="--oversubscribe")
    stages: int | None = _f(None, "pipeline/hybrid: stages the layers are cut into, a worker each")
    microbatches: int = _f(4, "pipeline/hybrid: micro-batches each worker's batch is cut into")
    schedule: str = _f("gpipe", "pipeline/hybrid: the pipeline schedule", choices=PIPELINE_SCHEDULES)
    split: str = _f("auto", "pipeline/hybrid: auto (balance the counted cost) or cut points, e.g. 3,5")
    batchnorm: str = _f("sync", "BatchNorm statistics: sync (over the whole global batch, as on one device) or "
                        "local (each worker's share, as the classic tower recipe; does not equal one device)",
                        choices=BATCHNORM)
    # optimisation
    batch_size: int | None = _f(None, "GLOBAL batch size, split evenly across workers (default: per dataset)")
    batch_per_worker: int | None = _f(None, "batch per worker instead: the global batch is this x workers")
    accumulate: int = _f(1, "micro-batches of --batch-size per optimizer step (gradient accumulation)")
    eval_batch_size: int = _f(2048, "batch size per worker for evaluation")
    epochs: int | None = _f(None, "training epochs (default: per dataset; --steps overrides it)")
    steps: int | None = _f(None, "training steps (optimizer updates); overrides --epochs")
    max_time: float | None = _f(None, "stop training after this many seconds, then evaluate and save")
    early_stopping: int | None = _f(None, "stop after this many epochs without a lower validation loss, then "
                                          "evaluate and save (the last weights)")
    optimizer: str = _f("adam", "optimizer", choices=OPTIMIZERS)
    lr: float = _f(2e-3, "learning rate")
    momentum: float = _f(0.9, "SGD/RMSprop momentum")
    beta1: float = _f(0.9, "Adam/Adamax/NAdam: decay of the gradient's running mean")
    beta2: float = _f(0.999, "Adam/Adamax/NAdam: decay of the squared gradient's running mean")
    label_smoothing: float = _f(0.0, "training loss: cross-entropy against targets smoothed by this much")
    nesterov: bool = _f(False, "SGD: Nesterov momentum", flag="--nesterov")
    weight_decay: float = _f(0.0, "L2 weight decay")
    clip_grad_norm: float | None = _f(None, "clip the gradients' global L2 norm to this")
    lr_schedule: str = _f("constant", "learning-rate schedule", choices=LR_SCHEDULES)
    lr_decay_rate: float = _f(0.1, "exponential/step: multiply the lr by this every decay period")
    lr_decay_steps: int | None = _f(None, "exponential/step: the decay period in steps")
    lr_decay_epochs: float | None = _f(None, "exponential/step: the decay period in epochs")
    lr_staircase: bool = _f(False, "exponential: decay in whole periods (the tutorial's staircase=True)",
                            flag="--lr-staircase")
    warmup_steps: int = _f(0, "linear warm-up from 0 to --lr over this many steps")
    ema: float | None = _f(None, "keep an exponential moving average of the weights with this decay")
    eval_ema: bool = _f(False, "evaluate (and report) with the averaged weights", flag="--eval-ema")
    test_flip: bool = _f(False, "evaluate on each image and its mirror image, averaging the two outputs",
                         flag="--test-flip")
    memory_format: str = _f("auto", "layout of the weights and batches: channels_last (fastest for CPU convolutions), "
                            "contiguous, or auto (channels_last for the registry's convolutional networks under "
                            "ddp)", choices=("auto", "channels_last", "contiguous"))
    compile: bool = _f(False, "torch.compile the model (on the CPU inductor needs a C++ compiler)",
                       flag="--compile")
    precision: str = _f("32", "32, bf16 (autocast) or 16-mixed (fp16 autocast + GradScaler)", choices=PRECISIONS)
    # augmentation of training batches, on the device (validation/test use the centre crop)
    random_crop: bool = _f(False, "random crop to the model's input size", flag="--random-crop")
    crop_padding: int = _f(0, "zero padding added before the random crop")
    hflip: bool = _f(False, "random horizontal flips", flag="--hflip")
    brightness: float = _f(0.0, "random brightness shift in [-b, b] (pixel scale 0..1)")
    contrast: float = _f(0.0, "random contrast factor in [1-c, 1+c]")
    seed: int = _f(0, "seed of the initial weights, the data order and dropout")
    # run directory, logs, checkpoints
    out: str | None = _f(None, "run directory (default: runs/<model>-<dataset>-<time>)")
    resume: str | None = _f(None, "continue the run in this run directory from its last checkpoint")
    overwrite: bool = _f(False, "clear a run already in --out (its config, checkpoints, logs) and start anew",
                         flag="--overwrite")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "how many step checkpoints to keep (last.pt is the newest of them); a "
                               "damaged newest one leaves the one before to carry on from")
    log_every: int = _f(50, "log training loss/accuracy every N steps")
    time_phases: bool = _f(False, "time data/compute/all-reduce/optimizer per step (no comm. overlap)",
                           flag="--time-phases")
    histogram_every: int = _f(0, "TensorBoard histograms of weights and gradients every N steps (0: never)")
    tensorboard: bool = _f(True, "write TensorBoard event files under RUN_DIR/tb", flag="--no-tensorboard",
                           off_help="write no TensorBoard event files (RUN_DIR/tb)")
    quiet: bool = _f(False, "no progress bar or per-epoch lines", flag="--quiet")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Sizes that suit each dataset: the 1,437 digits need small batches to get enough steps.
DATASET_DEFAULTS: dict[str, dict[str, int]] = {
    "digits": {"batch_size": 64, "epochs": 10},
    "mnist": {"batch_size": 512, "epochs": 5},
    "fashion-mnist": {"batch_size": 512, "epochs": 5},
    "kmnist": {"batch_size": 512, "epochs": 5},
    "cifar10": {"batch_size": 128, "epochs": 10},
    "cifar100": {"batch_size": 128, "epochs": 10},
    "synthetic": {"batch_size": 512, "epochs": 1},
    "imagefolder": {"batch_size": 64, "epochs": 10},
    "custom": {"batch_size": 64, "epochs": 10},
}

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def shown(value: Any, width: int = 60) -> str:
    """A value as a message shows it: its repr, cut to `width` characters (a value may be megabytes)."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = width
    short.maxlist = short.maxdict = 4
    return short.repr(value)


def did_you_mean(name: str, names: Any) -> str:
    """"; did you mean 'x'?" for the closest of `names`, or ""."""
    close = closest(name, names)
    return f"; did you mean '{close}'?" if close else ""


def _coerce(name: str, value: Any, where: str = "config key") -> Any:
    """Bring a YAML, flag or Python value to the field's type; a wrong type is a UserError naming the key.
    A string where a number or a bool belongs is read as YAML reads it ("0.01", "true")."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):  # TrainConfig(out=Path(...))
        value = os.fspath(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):  # NumPy integers, say
        value = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, str | int | float | bool):  # a list or mapping: nested aliases may be gigabytes
        raise UserError(f"{where} '{name}' must be a single value, not a {type(value).__name__}")
    kind = FIELDS[name].type
    if isinstance(value, str) and not kind.startswith("str") and name != "devices" and len(value) < 100:
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        value = parsed if isinstance(parsed, int | float | bool) else value
    try:
        if name == "devices":
            return str(value)
        if "bool" in kind:
            if not isinstance(value, bool):
                raise ValueError
            return value
        if "int" in kind:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if "float" in kind:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if not isinstance(value, str | int | float):
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        raise UserError(f"{where} '{name}' has an invalid value {shown(value)} (expected {kind})") from None


def _checked_init(self: TrainConfig, *args: Any, **values: Any) -> None:
    """TrainConfig(...) from Python: an unknown or misspelt field, or a value of the wrong type, is a UserError
    naming the field (a dataclass would raise a TypeError without it)."""
    if args:
        raise UserError("TrainConfig takes keyword arguments, such as TrainConfig(steps=100, devices='2')")
    for name in values:
        if name not in FIELDS:
            raise UserError(f"TrainConfig has no field '{name[:40]}'" + (
                did_you_mean(name, FIELDS) or "; the fields are the options of `paratrain train --help`, with "
                "underscores"))
    _dataclass_init(self, **{k: _coerce(k, v, "TrainConfig field") for k, v in values.items()})


_dataclass_init = TrainConfig.__init__
TrainConfig.__init__ = _checked_init  # type: ignore[method-assign]


def from_dict(values: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        names = ", ".join(k if len(k) <= 40 else k[:40] + "..." for k in unknown[:5])  # a key may be megabytes
        hint = did_you_mean(unknown[0], FIELDS) if len(unknown) == 1 and len(unknown[0]) <= 40 else ""
        raise UserError(f"unknown config key(s): {names}" + (hint or "; see `paratrain train --help`"))
    base = base or TrainConfig()
    return base.replace(**{k: _coerce(k, v) for k, v in values.items()})


def overlay(base: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """`values` on top of `base` (a resumed run's or a recipe's configuration), as flags go on top: a global
    batch drops the base's per-worker one, epochs drop the base's steps, and another strategy drops the
    base's stages, split and devices."""
    values = dict(values)
    if "batch_size" in values and "batch_per_worker" not in values:
        values["batch_per_worker"] = None  # an explicit global batch overrides a per-worker one
    if "epochs" in values and "steps" not in values:
        values["steps"] = None  # (--steps would win over them: mnist-fast's 351 steps over --epochs 3)
    for given, dropped in (("lr_decay_epochs", "lr_decay_steps"), ("lr_decay_steps", "lr_decay_epochs")):
        if given in values and dropped not in values:  # a decay period in one unit drops the base's other
            values[dropped] = None
    if values.get("strategy", base.strategy) != base.strategy:  # e.g. resuming a pipeline run with DDP
        values.setdefault("stages", None)
        values.setdefault("split", "auto")
        values.setdefault("devices", "auto")
    return from_dict(values, base)


def of_run(run: str | Path, given_as: str) -> TrainConfig:
    """The configuration a run was trained with (its config.yaml); `given_as` names how `run` was passed
    (`--resume RUN`, `resume=RUN`), for the error."""
    saved = Path(run) / "config.yaml"
    if not Path(run).exists():
        raise UserError(f"{given_as}: there is no such folder; pass the directory of a paratrain run")
    if not saved.is_file():
        raise UserError(f"{given_as}: no config.yaml there; pass the directory of a paratrain run")
    values = load_yaml(saved)
    values.setdefault("batchnorm", "local")  # saved before --batchnorm existed: it ran with each worker's share
    if values.get("dataset") in ("digits", "synthetic"):  # a --data-dir these never read (once accepted)
        values["data_dir"] = None
    return from_dict(values)


def check_resume_out(resume: str, out: str | None, drop: str) -> None:
    """A resumed run carries on in its own folder: another output folder beside --resume is refused (it was
    once silently ignored). `drop` names the option as the caller gave it (`--out X`, `out='X'`)."""
    if out and Path(out).resolve() != Path(resume).resolve():
        raise UserError(f"a resumed run carries on in its own folder, {resume}; drop {drop} (or copy the run "
                        "there and resume that copy)")


def with_run_dir(cfg: TrainConfig) -> TrainConfig:
    """The run directory: a resumed run's own folder, the given --out, or runs/<model>-<dataset>-<time>."""
    if cfg.resume:
        return cfg.replace(out=cfg.resume)
    if cfg.out:
        return cfg
    model = cfg.model
    if is_import_path(model):  # path/to/net.py:build -> net.build (a folder name, not a path)
        head, _, tail = model.rpartition(":")
        model = f"{Path(head).stem if head.endswith('.py') else head.rsplit('.', 1)[-1]}.{tail}"
    return cfg.replace(out=str(Path("runs") / f"{model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"))


MAX_YAML_BYTES = 256 * 1024


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text") from None
    if len(raw) > MAX_YAML_BYTES:
        raise UserError(f"config file {path} is larger than {MAX_YAML_BYTES // 1024} KiB; a configuration is a "
                        "few dozen lines")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # e.g. an integer past Python's 4,300-digit limit
        raise UserError(f"config file {path} holds a value that cannot be read ({shown(str(e))})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must be a mapping of key: value")
    # (a list or mapping value, such as nested aliases, is refused by _coerce before anything walks it)
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def save_yaml(cfg: TrainConfig, path: str | Path) -> None:
    from .rundir import write_atomic

    # both are recorded (a resume with --epochs drops the steps: overlay), but only one sets the length
    note = "# steps is set: it is the run's length, and epochs is not read\n" if cfg.steps is not None else ""
    write_atomic(Path(path), note + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def validate(cfg: TrainConfig) -> TrainConfig:
    """Fill the per-dataset defaults, then reject impossible values with a message that says what to do."""
    if cfg.dataset in DATASET_DEFAULTS:
        cfg = cfg.replace(**{k: v for k, v in DATASET_DEFAULTS[cfg.dataset].items() if getattr(cfg, k) is None})
    if is_import_path(cfg.model):  # config.yaml names the same file from any folder
        cfg = cfg.replace(model=absolute(cfg.model))
    if cfg.data_dir:  # and the same data: --resume from another folder reads what the run read
        cfg = cfg.replace(data_dir=str(Path(cfg.data_dir).expanduser().resolve()))
    _check_choices(cfg)
    _check_numbers(cfg)
    _check_combinations(cfg)
    return cfg  # what a strategy cannot take is its own to refuse (strategies.checked)


def _bad(msg: str) -> None:
    raise UserError(msg)


def _check_choices(cfg: TrainConfig) -> None:
    for name, value in (("model", cfg.model), ("dataset", cfg.dataset), ("optimizer", cfg.optimizer),
                        ("activation", cfg.activation), ("accelerator", cfg.accelerator),
                        ("lr_schedule", cfg.lr_schedule), ("precision", cfg.precision),
                        ("strategy", cfg.strategy), ("param_device", cfg.param_device),
                        ("schedule", cfg.schedule), ("batchnorm", cfg.batchnorm), ("labels", cfg.labels)):
        choices = FIELDS[name].metadata["choices"]
        if name == "model" and is_import_path(value):
            continue
        if value not in choices:  # custom: what paratrain.fit records for a factory, not a choice to make
            _bad(f"unknown {name} {shown(value)}{did_you_mean(str(value), choices)}; choose one of: "
                 f"{', '.join(c for c in choices if c != 'custom')}")
    if cfg.devices != "auto" and not (cfg.devices.isdigit() and int(cfg.devices) >= 1):
        _bad(f"--devices must be 'auto' or a positive number, not '{cfg.devices}'")


def _check_numbers(cfg: TrainConfig) -> None:
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        _bad(f"--lr must be a positive number, not {cfg.lr}")
    positive = {"batch_size": cfg.batch_size, "eval_batch_size": cfg.eval_batch_size,
                "epochs": cfg.epochs, "log_every": cfg.log_every, "width": cfg.width, "depth": cfg.depth,
                "filters": cfg.filters, "kernel": cfg.kernel}
    if cfg.steps is not None:
        positive["steps"] = cfg.steps
    positive.update(accumulate=cfg.accumulate, keep_checkpoints=cfg.keep_checkpoints, microbatches=cfg.microbatches)
    for name in ("threads_per_worker", "batch_per_worker", "lr_decay_steps", "image_size", "early_stopping"):
        if getattr(cfg, name) is not None:
            positive[name] = getattr(cfg, name)
    for name in ("lr_decay_epochs", "max_time", "clip_grad_norm", "collective_timeout"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            _bad(f"--{name.replace('_', '-')} must be a positive number, not {value}")
    for name, value in positive.items():
        if value < 1:
            _bad(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    for name, value in (("momentum", cfg.momentum), ("weight_decay", cfg.weight_decay),
                        ("checkpoint_every", cfg.checkpoint_every), ("val_size", cfg.val_size or 0),
                        ("test_size", cfg.test_size or 0),
                        ("warmup_steps", cfg.warmup_steps), ("crop_padding", cfg.crop_padding),
                        ("brightness", cfg.brightness), ("contrast", cfg.contrast),
                        ("histogram_every", cfg.histogram_every), ("max_restarts", cfg.max_restarts)):
        if value < 0:
            _bad(f"--{name.replace('_', '-')} must not be negative, not {value}")
    for name in ("beta1", "beta2", "label_smoothing"):  # torch's own ranges: a decay or a share, below 1
        value = getattr(cfg, name)
        if not (math.isfinite(value) and 0 <= value < 1):
            _bad(f"--{name.replace('_', '-')} must be at least 0 and below 1, not {value}")


def _check_combinations(cfg: TrainConfig) -> None:
    if cfg.data_dir and cfg.dataset in ("digits", "synthetic"):
        _bad(f"--data-dir is not read by --dataset {cfg.dataset}; for a folder with a sub-folder of images per "
             "class, pass --dataset imagefolder")
    folder_only = [n for n in ("test_size", "image_size", "cache_dir") if getattr(cfg, n) is not None]
    folder_only += ["skip_bad_images"] if cfg.skip_bad_images else []
    if cfg.labels != "fine" and cfg.dataset != "cifar100":
        _bad(f"--labels is for --dataset cifar100, not {cfg.dataset}")
    if folder_only and cfg.dataset not in ("imagefolder", "custom"):  # custom: a Dataset given to paratrain.fit
        _bad(f"--{folder_only[0].replace('_', '-')} is for --dataset imagefolder, not {cfg.dataset}")
    if cfg.dropout is not None and not 0 <= cfg.dropout < 1:
        _bad(f"--dropout must be in [0, 1), not {cfg.dropout}")
    if cfg.ema is not None and not 0 < cfg.ema < 1:
        _bad(f"--ema must be a decay in (0, 1), such as 0.999; not {cfg.ema}")
    if cfg.overwrite and cfg.resume:
        _bad("--overwrite starts a new run in --out and --resume carries one on; drop one of them")
    if cfg.early_stopping is not None and cfg.val_size == 0:
        _bad("--early-stopping watches the validation loss: drop --val-size 0")
    if cfg.optimizer == "sgd" and cfg.nesterov and cfg.momentum == 0:  # torch.optim.SGD would raise in the workers
        _bad("--nesterov needs --momentum above 0")
    if cfg.eval_ema and cfg.ema is None:
        _bad("--eval-ema needs --ema DECAY")
    if not 0 < cfg.lr_decay_rate <= 1 and cfg.lr_schedule in ("exponential", "step"):
        _bad(f"--lr-decay-rate must be in (0, 1], not {cfg.lr_decay_rate}")
    if cfg.lr_schedule in ("exponential", "step") and not (cfg.lr_decay_steps or cfg.lr_decay_epochs):
        _bad(f"--lr-schedule {cfg.lr_schedule} needs --lr-decay-steps or --lr-decay-epochs")


# Options that only some optimizers or schedules read: given for another, they would change nothing.
_ADAMS, _DECAYS = ("optimizer", ("adam", "adamax", "nadam")), ("lr_schedule", ("exponential", "step"))
READ_BY = {"momentum": ("optimizer", ("sgd", "rmsprop")), "nesterov": ("optimizer", ("sgd",)), "beta1": _ADAMS,
           "beta2": _ADAMS, "lr_decay_rate": _DECAYS, "lr_decay_steps": _DECAYS, "lr_decay_epochs": _DECAYS,
           "lr_staircase": ("lr_schedule", ("exponential",))}


def unread(cfg: TrainConfig, given: Iterable[str]) -> dict[str, str]:
    """Of the options `given`, those that this run's optimizer or schedule does not read (`--momentum` with
    Adam), each with a clause in flag words that says so: the user meant them to change something."""
    found = {}
    for name in sorted(set(given) & set(READ_BY)):
        owner, readers = READ_BY[name]
        value, flag, owner_flag = getattr(cfg, owner), _flag(name), _flag(owner)
        if value == "custom":  # an optimizer factory of the user's (paratrain.fit): it takes its own settings
            found[name] = f"{flag} is not read by an optimizer of your own (optimizer=)"
        elif value not in readers:
            found[name] = f"{flag} is not read by {owner_flag} {value}, only by {owner_flag} {' or '.join(readers)}"
    return found


def _flag(name: str) -> str:
    return FIELDS[name].metadata.get("flag", "--" + name.replace("_", "-"))


def check_read(cfg: TrainConfig, given: Iterable[str]) -> None:
    """Refuse options the user gave (flags, or a TrainConfig's fields that differ from the defaults) that the
    run would not read, and a decay period given in both units (the steps would win)."""
    given = set(given)
    if {"lr_decay_steps", "lr_decay_epochs"} <= given:
        _bad("give the decay period once: --lr-decay-steps or --lr-decay-epochs, not both")
    for name, clause in unread(cfg, given).items():
        own = getattr(cfg, READ_BY[name][0]) == "custom"
        _bad(f"{clause}: drop it" + (" (your factory sets its own)" if own else ", or choose one of those"))


def changed(cfg: TrainConfig) -> set[str]:
    """The fields of `cfg` that differ from the defaults: what a TrainConfig's author set."""
    default = TrainConfig()
    return {name for name in FIELDS if getattr(cfg, name) != getattr(default, name)}


def in_python_words(message: str) -> str:
    """A validation message for a Python caller: `--val-size` becomes `val_size`, the TrainConfig field
    it set (flags that are not fields stay as they are)."""
    import re

    def field(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        return name if name in FIELDS else m.group(0)

    return re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)", field, message)
