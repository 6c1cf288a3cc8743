"""Validation: the per-dataset defaults filled in, impossible values refused in one line that says what to do,
and the options given that the run would not read."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from ..core.errors import UserError
from ..core.import_path import absolute, is_own_network
from ..core.optional import require
from ..core.urls import masked, password_of
from .fields import (
    DATASET_DEFAULTS,
    FIELDS,
    LOGGERS,
    METRICS,
    TrainConfig,
    did_you_mean,
    loggers,
    model_for_data,
    shown,
    tokenizer_for_model,
)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Fill the per-dataset defaults, then reject impossible values with a message that says what to do."""
    cfg = tokenizer_for_model(model_for_data(cfg))
    if cfg.dataset in DATASET_DEFAULTS:
        cfg = cfg.replace(**{k: v for k, v in DATASET_DEFAULTS[cfg.dataset].items() if getattr(cfg, k) is None})
    if is_own_network(cfg.model):  # config.yaml names the same file or folder from any folder
        cfg = cfg.replace(model=absolute(cfg.model))
    if cfg.init_from:  # (workers and restarts in another folder read the same)
        cfg = cfg.replace(init_from=str(Path(cfg.init_from).expanduser().resolve()))
    if cfg.data_dir:  # and the same data: --resume from another folder reads what the run read
        cfg = cfg.replace(data_dir=str(Path(cfg.data_dir).expanduser().resolve()))
    _check_choices(cfg)
    _check_metrics(cfg.metric)
    _check_loggers(cfg)
    _check_numbers(cfg)
    _check_combinations(cfg)
    return cfg  # what a strategy cannot take is its own to refuse (strategies.checked)


def _bad(msg: str) -> None:
    raise UserError(msg)


def _check_metrics(text: str | None) -> None:
    chosen = [n.strip() for n in (text or "").split(",")]
    for name in chosen if text is not None else ():
        if name not in METRICS:
            close = did_you_mean(name, METRICS) or "."
            _bad(f"--metric {shown(name)} is not a metric paratrain knows{close} Choose from {', '.join(METRICS)}, "
                 "comma-separated (Python: metrics= takes torchmetrics objects too)")
    if len(set(chosen)) != len(chosen):
        _bad(f"--metric names a metric twice: {text}")


def _check_loggers(cfg: TrainConfig) -> None:
    for name in loggers(cfg):
        if name not in LOGGERS:
            _bad(f"--logger {shown(name)} is not a logger paratrain knows{did_you_mean(name, LOGGERS) or '.'} Choose "
                 f"one or more of {', '.join(LOGGERS)}, comma-separated (none: metrics.jsonl alone)")
        if name in ("mlflow", "wandb"):  # before any worker starts (tensorboard's absence is a note: it goes on)
            require(name, f"--logger {name}")
    if len(set(loggers(cfg))) != len(loggers(cfg)):
        _bad(f"--logger names a logger twice: {cfg.logger}")
    if cfg.mlflow_uri and password_of(cfg.mlflow_uri):  # config.yaml records the options
        _bad(f"--mlflow-uri {masked(cfg.mlflow_uri)} holds a password, which the run folder's config.yaml would keep "
             "in plain text: pass the URI without it and export MLFLOW_TRACKING_USERNAME and "
             "MLFLOW_TRACKING_PASSWORD (or put the whole URI in $MLFLOW_TRACKING_URI)")


def _check_choices(cfg: TrainConfig) -> None:
    for name, value in (("model", cfg.model), ("dataset", cfg.dataset), ("optimizer", cfg.optimizer),
                        ("activation", cfg.activation), ("accelerator", cfg.accelerator),
                        ("lr_schedule", cfg.lr_schedule), ("precision", cfg.precision),
                        ("strategy", cfg.strategy), ("param_device", cfg.param_device),
                        ("schedule", cfg.schedule), ("batchnorm", cfg.batchnorm), ("labels", cfg.labels),
                        ("requeue_signal", cfg.requeue_signal), ("loss", cfg.loss),
                        ("activation_checkpointing", cfg.activation_checkpointing)):
        choices = FIELDS[name].metadata["choices"]
        if name == "model" and is_own_network(value):
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
                        ("histogram_every", cfg.histogram_every), ("max_restarts", cfg.max_restarts),
                        ("max_requeues", cfg.max_requeues)):
        if value < 0:
            _bad(f"--{name.replace('_', '-')} must not be negative, not {value}")
    for name in ("beta1", "beta2", "label_smoothing"):  # torch's own ranges: a decay or a share, below 1
        value = getattr(cfg, name)
        if not (math.isfinite(value) and 0 <= value < 1):
            _bad(f"--{name.replace('_', '-')} must be at least 0 and below 1, not {value}")


def _check_text(cfg: TrainConfig) -> None:
    """Text's and the gpt's own options."""
    if cfg.tokenizer != "bytes" and cfg.dataset not in ("text", "jsonl"):
        _bad(f"--tokenizer is for --dataset text or jsonl, not {cfg.dataset}")
    if cfg.context < 1:
        _bad(f"--context must be at least 1 token, not {cfg.context}")
    if cfg.heads is not None and cfg.model != "gpt":
        _bad(f"--heads is for --model gpt, not {cfg.model}")
    if cfg.heads is not None and cfg.heads < 1:
        _bad(f"--heads must be at least 1, not {cfg.heads}")
    heads = cfg.heads or max(1, cfg.width // 64)  # the gpt's default (models/gpt.py)
    if cfg.model == "gpt" and cfg.width % heads:
        _bad(f"--heads {heads}{'' if cfg.heads else ' (width / 64, the default)'} must divide --width {cfg.width} "
             "(each head has width / heads): give --heads, or a --width that it divides")


def _check_lora(cfg: TrainConfig) -> None:
    """LoRA's options: a rank of 1 or more, a positive alpha, a dropout below 1, and none of them without --lora."""
    if cfg.lora < 0:
        _bad(f"--lora is the adapters' rank: 1 or more (0: no adapters), not {cfg.lora}")
    if cfg.lora_alpha is not None and not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
        _bad(f"--lora-alpha must be a positive number, not {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        _bad(f"--lora-dropout must be in [0, 1), not {cfg.lora_dropout}")
    given = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(cfg, n) != FIELDS[n].default]
    if given and not cfg.lora:
        _bad(f"--{given[0].replace('_', '-')} is LoRA's: give --lora RANK too")


def _check_pack(cfg: TrainConfig) -> None:
    """--pack: examples of --dataset jsonl, for a network that reads their position_ids."""
    if cfg.pack and cfg.dataset != "jsonl":
        _bad(f"--pack packs --dataset jsonl's examples into windows, not {cfg.dataset}'s"
             + (" (text is read as full windows already)" if cfg.dataset == "text" else ""))
    if cfg.pack and cfg.model not in ("gpt", "custom") and not is_own_network(cfg.model):
        _bad(f"--pack keeps packed examples apart by their position_ids, which the gpt and Hugging Face models (and "
             f"a network of yours that takes input_ids and position_ids) read, and {cfg.model} does not: give "
             "--model gpt or hf:PATH, or leave --pack out")


def _check_combinations(cfg: TrainConfig) -> None:
    if cfg.data_dir and cfg.dataset in ("digits", "synthetic", "diabetes", "tokens"):
        _bad(f"--data-dir is not read by --dataset {cfg.dataset}; for a folder with a sub-folder of images per "
             "class, pass --dataset imagefolder")
    if cfg.label_smoothing and cfg.loss not in ("auto", "cross-entropy"):
        _bad(f"--label-smoothing smooths the cross-entropy's class targets, not --loss {cfg.loss}: drop one")
    if cfg.columns is not None and cfg.dataset != "jsonl":
        _bad(f"--columns names the columns of --dataset jsonl's examples, not of {cfg.dataset}")
    if cfg.target is not None and cfg.dataset != "csv":
        _bad(f"--target names a column of --dataset csv, not of {cfg.dataset}")
    if cfg.dataset in ("tensors", "csv", "text", "jsonl") and not cfg.data_dir:
        _bad(f"--dataset {cfg.dataset} needs --data-dir " + {"csv": "FILE.csv, the table",
                                                              "text": "PATH, a UTF-8 file or a folder of .txt files",
                                                              "jsonl": "FILE.jsonl, JSON lines of {\"prompt\", "
                                                                       "\"response\"} or {\"messages\"}"}
             .get(cfg.dataset, "PATH, an .npz file or a folder of .npy/.pt files"))
    _check_text(cfg)
    _check_lora(cfg)
    _check_pack(cfg)
    if cfg.dataset == "csv" and not cfg.target:
        _bad("--dataset csv needs --target COLUMN: the column to predict (several: A,B)")
    folder_only = [n for n in ("image_size", "cache_dir") if getattr(cfg, n) is not None and
                   not (n == "cache_dir" and cfg.dataset == "text")]  # text keeps its tokens in the cache too
    folder_only += ["skip_bad_images"] if cfg.skip_bad_images else []
    if cfg.test_size is not None and cfg.dataset not in ("imagefolder", "custom", "tensors", "csv", "diabetes",
                                                         "tokens", "text", "jsonl"):
        _bad(f"--test-size is for --dataset imagefolder, tensors, csv, text or jsonl, not {cfg.dataset}")
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
    if cfg.init_from and cfg.resume:
        _bad("--init-from starts a new run from these weights and --resume carries one on from its own checkpoint; "
             "drop one of them")
    if cfg.early_stopping is not None and cfg.val_size == 0:
        _bad("--early-stopping watches the validation loss: drop --val-size 0")
    if cfg.optimizer == "sgd" and cfg.nesterov and cfg.momentum == 0:  # torch.optim.SGD would raise in the workers
        _bad("--nesterov needs --momentum above 0")
    if cfg.eval_ema and cfg.ema is None:
        _bad("--eval-ema needs --ema DECAY")
    if not 0 < cfg.lr_decay_rate <= 1 and cfg.lr_schedule in ("exponential", "step"):
        _bad(f"--lr-decay-rate must be in (0, 1], not {cfg.lr_decay_rate}")
    if cfg.compile and cfg.activation_checkpointing != "none":  # untried together: refused rather than guessed
        _bad("--compile with --activation-checkpointing is not available yet; leave one of them out")
    if not (cfg.selective_ac == "attention" or (cfg.selective_ac.isdigit() and int(cfg.selective_ac) >= 1)):
        _bad(f"--selective-ac must be a positive whole number K (blocks 1, K+1, 2K+1, ... are recomputed) or "
             f"'attention', not {shown(cfg.selective_ac)}")
    if cfg.lr_schedule in ("exponential", "step") and not (cfg.lr_decay_steps or cfg.lr_decay_epochs):
        _bad(f"--lr-schedule {cfg.lr_schedule} needs --lr-decay-steps or --lr-decay-epochs")


# Options that only some optimizers or schedules read: given for another, they would change nothing.
_ADAMS, _DECAYS = ("optimizer", ("adam", "adamw", "adamax", "nadam")), ("lr_schedule", ("exponential", "step"))
READ_BY = {"momentum": ("optimizer", ("sgd", "rmsprop")), "nesterov": ("optimizer", ("sgd",)), "beta1": _ADAMS,
           "beta2": _ADAMS, "lr_decay_rate": _DECAYS, "lr_decay_steps": _DECAYS, "lr_decay_epochs": _DECAYS,
           "lr_staircase": ("lr_schedule", ("exponential",)),
           "selective_ac": ("activation_checkpointing", ("selective",))}


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
    it set, and a switch the value it sets (`--overwrite` -> `overwrite=True`, `--no-download` ->
    `download=False`); flags that are not fields stay as they are."""
    import re

    switches = {f.metadata.get("flag", "--" + name.replace("_", "-"))[2:]: f"{name}={not f.default}"
                for name, f in FIELDS.items() if f.type == "bool"}

    def field(m: re.Match) -> str:
        if m.group(1) in switches:
            return switches[m.group(1)]
        name = m.group(1).replace("-", "_")
        return name if name in FIELDS else m.group(0)

    return re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)", field, message)

