"""The training configuration's fields: every option of `paratrain train`, with its default, its help and its
choices (cli/parser.py builds the flags from them), and the coercion of a value from YAML, a flag or Python
to the field's type."""

from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import UserError, closest
from ..core.import_path import HF

# custom: paratrain.fit(model=...)
MODELS = ("lenet5", "convnet", "mnist-net", "cifar10-net", "mnist-fast-net", "cifar10-fast-net", "mlp", "gru",
          "gpt", "custom")
# imagefolder: a folder of class sub-folders (--data-dir); tensors: an .npz or a folder of .npy/.pt files; csv: a
# table (--target); text: a UTF-8 file or a folder of .txt files; custom: tensors given to paratrain.fit
DATASETS = ("digits", "mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "synthetic", "diabetes", "tokens",
            "imagefolder", "tensors", "csv", "text", "jsonl", "custom")
FILES = ("imagefolder", "tensors", "csv", "text", "jsonl")  # the datasets that are --data-dir itself
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # save_pretrained's
# custom: an optimizer factory given to paratrain.fit
OPTIMIZERS = ("adam", "adamw", "sgd", "gd", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "custom")
LR_SCHEDULES = ("constant", "exponential", "step", "cosine")
PRECISIONS = ("32", "tf32", "bf16", "16-mixed", "float8")
ACTIVATIONS = ("relu", "elu", "tanh", "sigmoid")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
BATCHNORM = ("sync", "local")
# Slurm's pre-emption and time-limit warnings (USR2 where NCCL catches USR1; TERM is a stop, never a requeue)
REQUEUE_SIGNALS = ("USR1", "USR2", "URG", "HUP")
# the parallelisms (strategies/ registers a class for each; its `check` refuses what one cannot take)
STRATEGIES = ("ddp", "tower", "pipeline", "hybrid", "fsdp", "hsdp", "tp")
# --loss: auto is cross-entropy for integer targets (class indices, or token ids N x T against N x T x V outputs),
# else the mean squared error (losses.py)
LOSSES = ("auto", "cross-entropy", "mse", "l1", "smooth-l1", "bce", "model")
# --metric's built-in metrics (torchmetrics objects: metrics.py builds them)
METRICS = ("mae", "mse", "rmse", "r2", "f1", "precision", "recall")
# --logger: where a run's figures go beside metrics.jsonl (tracking/trackers.py; tensorboard: tracking/log.py)
LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class TrainConfig:
    # what to train
    model: str = _f("lenet5", "a registry model, or your network's factory: package.module:factory or "
                    "path/to/file.py:factory", choices=MODELS)
    dataset: str = _f("digits", "dataset (digits, diabetes (a regression) and tokens (sequences) are embedded and "
                      "need no download); imagefolder, tensors (an .npz, or a folder of .npy/.pt files: x_train, "
                      "y_train, ...), csv (a table), text (UTF-8, for "
                      "a language model) and jsonl (prompts and responses, or chats: JSON lines, parquet or arrow) "
                      "are --data-dir",
                      choices=DATASETS)
    data_dir: str | None = _f(None, "folder with the dataset files, or where to download them; the image folder, "
                              "tensors file, CSV file, text (a UTF-8 file or a folder of .txt files), or examples (a "
                              ".jsonl, .parquet or .arrow file)")
    columns: str | None = _f(None, "jsonl: the columns that hold each example, where they are not named prompt and "
                             "response, or messages: prompt=COL,response=COL or messages=COL")
    pack: bool = _f(False, "jsonl: several examples to a --context window, each at its own positions, seeing itself")
    tokenizer: str = _f("bytes", "text and jsonl: bytes (a vocabulary of 256, no dependency), a tiktoken encoding "
                        "(gpt2, cl100k_base; pip install tiktoken), a Hugging Face tokenizer.json or hub name, or a "
                        "model folder (--model hf:PATH brings its own)")
    context: int = _f(128, "text, jsonl and gpt: tokens a training window (an example) holds; gpt: the longest "
                      "sequence it reads")
    standardize: bool = _f(False, "tensors: scale every input feature to zero mean and unit variance over the "
                           "training split (the network takes them so)", flag="--standardize")
    target: str | None = _f(None, "csv: the column to predict (several: A,B); numbers are a regression's, names "
                            "or whole numbers are classes")
    download: bool = _f(True, "download a missing dataset through torchvision", flag="--no-download",
                        off_help="never download: a missing dataset is an error")
    val_size: int | None = _f(None, "training examples held out for validation (default: per dataset)")
    labels: str = _f("fine", "cifar100: its 100 fine classes or its 20 coarse ones", choices=("fine", "coarse"))
    test_size: int | None = _f(None, "imagefolder without a test/ folder, tensors or csv without x_test, text, "
                               "jsonl: examples held out for testing (default: a tenth)")
    image_size: int | None = _f(None, "imagefolder: the side images are resized and centre-cropped to "
                                "(default: the median, at most 224)")
    cache_dir: str | None = _f(None, "imagefolder: where the decoded images are cached (default: "
                               "~/.cache/paratrain/folders, or $XDG_CACHE_HOME's; never inside --data-dir)")
    skip_bad_images: bool = _f(False, "imagefolder: leave out images that cannot be decoded (counted and "
                               "listed in the cache's manifest) instead of stopping")
    host_data: bool = _f(False, "GPUs: keep a dataset held in memory on the host, each batch copied to the GPU "
                         "(pinned, the next one read ahead), where it would not fit beside the model (default: "
                         "moved to the GPU whole)", flag="--host-data")
    # model options (used by the models that have them)
    width: int = _f(512, "mlp: neurons per hidden layer; gru: the embedding's and the GRU's width; gpt: the "
                    "model's width (embedding, attention)")
    depth: int = _f(2, "mlp: number of hidden layers; gru: stacked GRU layers; gpt: transformer blocks")
    heads: int | None = _f(None, "gpt: attention heads (default: width / 64, at least 1); they must divide --width")
    activation: str = _f("relu", "mlp: activation", choices=ACTIVATIONS)
    dropout: float | None = _f(None, "dropout probability (default: the model's own)")
    filters: int = _f(64, "convnet: filters of the first convolution (the next two have 4x and 8x); "
                      "cifar10-fast-net: of its first block (the next two have 4x)")
    kernel: int = _f(5, "convnet: kernel size of the first convolution")
    lora: int = _f(0, "train low-rank adapters of this rank (PEFT's LoRA) beside the model's weights, which stay "
                   "frozen; 0: train every weight")
    lora_alpha: float | None = _f(None, "LoRA: the adapters' scale is alpha / rank (default: alpha 2 x rank)")
    lora_dropout: float = _f(0.0, "LoRA: dropout of the adapters' input")
    lora_targets: str = _f("all-linear", "LoRA: the layers given adapters, by name (q_proj,v_proj), or all-linear "
                           "(every linear layer but a language model's output head)")
    # where to run
    accelerator: str = _f("auto", "cpu, gpu, or auto (gpu when there is one)", choices=("auto", "cpu", "gpu"))
    strategy: str = _f("ddp", "ddp: a process per device; tower: one process, parameters on --param-device; "
                       "pipeline: the layers cut into --stages, a process each; hybrid: data x pipeline; fsdp: "
                       "sharded data parallel (each worker holds 1/N of the weights, gradients and optimizer "
                       "state); hsdp: fsdp within groups of --shard-size workers, replicated across them; tp: tensor "
                       "parallel (each block's heads and hidden units split over the workers)", choices=STRATEGIES)
    mesh: str | None = _f(None, "the workers as named dimensions, e.g. fsdp=2,tp=2 or dp=2,tp=2,pp=2 (dp: copies, "
                          "fsdp: sharded copies, tp: tensor parallel, pp: pipeline stages); their product is the "
                          "workers, and it picks the strategy")
    tp_plan: str | None = _f(None, "tp: a YAML file of module-name patterns to colwise, rowwise or colwise_rep "
                             "(outputs gathered), e.g. 'layers.*.up: colwise' (default: the model's own plan)")
    param_device: str = _f("auto", "tower: where the parameters live: cpu, cuda:0, or auto (cuda:0 on GPUs)",
                           choices=("auto", "cpu", "cuda:0"))
    devices: str = _f("auto", "workers (processes): auto or a number")
    threads_per_worker: int | None = _f(None, "CPU threads per worker (default: cores / workers)")
    max_restarts: int = _f(0, "restart every worker from the last checkpoint when one dies, up to this many times")
    collective_timeout: float = _f(300.0, "seconds a collective may wait for a worker before the run ends")
    requeue_signal: str = _f("USR1", "Slurm: the signal (sbatch --signal=SIG@SECONDS) on which every task "
                             "checkpoints, the job is requeued, and Slurm's next start carries the run on",
                             choices=REQUEUE_SIGNALS)
    max_requeues: int = _f(3, "Slurm: requeue a stopped job at most this many times, then stop with its checkpoint")
    oversubscribe: bool = _f(False, "allow more CPU workers than cores (much slower; for tests)",
                             flag="--oversubscribe")
    stages: int | None = _f(None, "pipeline/hybrid: stages the layers are cut into, a worker each")
    microbatches: int = _f(4, "pipeline/hybrid: micro-batches each worker's batch is cut into")
    schedule: str = _f("gpipe", "pipeline/hybrid: the pipeline schedule", choices=PIPELINE_SCHEDULES)
    split: str = _f("auto", "pipeline/hybrid: auto (balance the counted cost) or cut points, e.g. 3,5")
    shard_modules: str | None = _f(None, "fsdp/hsdp: the blocks sharded (and gathered) one at a time, as "
                                   "module names, e.g. layers.0,layers.1 (default: the model's blocks)")
    reshard_after_forward: bool = _f(True, "fsdp/hsdp: free each block's gathered weights after its forward "
                                     "(gather again in the backward)", flag="--no-reshard-after-forward",
                                     off_help="fsdp/hsdp: keep each block's gathered weights from its forward "
                                     "to its backward (more memory, less traffic)")
    shard_size: int | None = _f(None, "hsdp: workers each tensor is sharded over (the rest are copies; "
                                "default: the workers of one node)")
    cpu_offload: bool = _f(False, "fsdp/hsdp on GPUs: keep the sharded weights, gradients and optimizer state "
                           "in CPU memory", flag="--cpu-offload")
    batchnorm: str = _f("sync", "BatchNorm statistics: sync (over the whole global batch, as on one device) or "
                        "local (each worker's share, as the classic tower recipe; does not equal one device)",
                        choices=BATCHNORM)
    # optimisation
    batch_size: int | None = _f(None, "GLOBAL batch size, split evenly across workers (default: per dataset)")
    batch_per_worker: int | None = _f(None, "batch per worker instead: the global batch is this x workers")
    accumulate: int = _f(1, "micro-batches of --batch-size per optimizer step (gradient accumulation)")
    eval_batch_size: int = _f(2048, "batch size per worker for evaluation (a pipeline evaluates in "
                                  "batches of its training batch: its stages' shapes are fixed)")
    epochs: int | None = _f(None, "training epochs (default: per dataset; --steps overrides it)")
    steps: int | None = _f(None, "training steps (optimizer updates); overrides --epochs")
    max_time: float | None = _f(None, "stop training after this many seconds, then evaluate and save")
    early_stopping: int | None = _f(None, "stop after this many epochs without a lower validation loss, then "
                                          "evaluate and save (the last weights)")
    optimizer: str = _f("adam", "optimizer", choices=OPTIMIZERS)
    lr: float = _f(2e-3, "learning rate")
    momentum: float = _f(0.9, "SGD/RMSprop momentum")
    beta1: float = _f(0.9, "Adam/AdamW/Adamax/NAdam: decay of the gradient's running mean")
    beta2: float = _f(0.999, "Adam/AdamW/Adamax/NAdam: decay of the squared gradient's running "
                        "mean")
    loss: str = _f("auto", "the loss trained and reported: auto (cross-entropy for class indices and for token "
                   "ids, N x T targets against N x T x V outputs (-100: ignored); else the mean squared error), "
                   "cross-entropy, mse, l1, smooth-l1, bce (binary cross-entropy on logits: "
                   "multi-label targets of 0/1), model (the loss your network returns from the labels it is "
                   "given: a Hugging Face model's; auto's choice for inputs with a labels column)", choices=LOSSES)
    label_smoothing: float = _f(0.0, "training loss: cross-entropy against targets smoothed by this much")
    metric: str | None = _f(None, "metrics reported beside the loss on the validation and test sets, "
                            f"comma-separated: {', '.join(METRICS)} (f1, precision, recall: the mean over the "
                            "classes)")
    nesterov: bool = _f(False, "SGD: Nesterov momentum", flag="--nesterov")
    weight_decay: float = _f(0.0, "weight decay: L2 added to the gradient; adamw: decoupled, as transformers train")
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
    activation_checkpointing: str = _f("none", "keep no activations of the network's blocks for the backward but "
                                       "recompute them there (about one more forward, for memory): full (every "
                                       "block), selective (the blocks --selective-ac names) or none",
                                       choices=("none", "full", "selective"))
    selective_ac: str = _f("2", "--activation-checkpointing selective: every K-th block (K), or each block's "
                           "attention alone (attention)")
    precision: str = _f("32", "32, tf32 (float32 with a GPU's matrix products on TF32 tensor cores: Ampere or "
                        "later), bf16 (autocast), 16-mixed (fp16 autocast + GradScaler) or float8 (torchao's "
                        "float8 matrix products in the linear layers, bf16 autocast elsewhere; GPUs of compute "
                        "capability 8.9 or later, under ddp and fsdp)", choices=PRECISIONS)
    # augmentation of training batches, on the device (validation/test use the centre crop)
    random_crop: bool = _f(False, "random crop to the model's input size", flag="--random-crop")
    crop_padding: int = _f(0, "zero padding added before the random crop")
    hflip: bool = _f(False, "random horizontal flips", flag="--hflip")
    brightness: float = _f(0.0, "random brightness shift in [-b, b] (pixel scale 0..1)")
    contrast: float = _f(0.0, "random contrast factor in [1-c, 1+c]")
    seed: int = _f(0, "seed of the initial weights, the data order and dropout")
    init_from: str | None = _f(None, "start from these weights instead of drawing them: a Hugging Face model folder "
                               "(config.json and .safetensors files, as save_pretrained writes them) or a paratrain "
                               "run (its newest checkpoint); each worker reads only its part of each weight")
    # run directory, logs, checkpoints
    out: str | None = _f(None, "run directory (default: runs/<model>-<dataset>-<time>)")
    resume: str | None = _f(None, "continue the run in this run directory from its last checkpoint")
    overwrite: bool = _f(False, "clear a run already in --out (its config, checkpoints, logs) and start anew",
                         flag="--overwrite")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "how many step checkpoints to keep (step folders); a damaged newest one "
                               "leaves the one before to carry on from")
    async_checkpoint: bool = _f(False, "write each checkpoint in the background while training goes on (the "
                                "loop waits for a copy of the state, and for the save before, not for the disk)",
                                flag="--async-checkpoint")
    log_every: int = _f(50, "log training loss/accuracy every N steps")
    time_phases: bool = _f(False, "time data/compute/all-reduce/optimizer per step (no comm. overlap)",
                           flag="--time-phases")
    histogram_every: int = _f(0, "TensorBoard histograms of weights and gradients every N steps (0: never)")
    tensorboard: bool = _f(True, "write TensorBoard event files under RUN_DIR/tb", flag="--no-tensorboard",
                           off_help="write no TensorBoard event files (RUN_DIR/tb)")
    logger: str = _f("tensorboard", "where the run's figures also go: one or more of tensorboard (RUN_DIR/tb), csv "
                     "(RUN_DIR/metrics.csv), mlflow, wandb, comma-separated (none: metrics.jsonl alone, which every "
                     "run writes); --no-tensorboard leaves tensorboard out")
    mlflow_uri: str | None = _f(None, "mlflow: the tracking server or store (default: $MLFLOW_TRACKING_URI, else "
                                "MLflow's own default in the current folder: mlflow.db and mlruns/); a password "
                                "belongs in $MLFLOW_TRACKING_PASSWORD")
    experiment: str | None = _f(None, "mlflow: the experiment, wandb: the project the run is logged to (default: "
                                "the name of the run folder's parent folder)")
    quiet: bool = _f(False, "no progress bar or per-epoch lines", flag="--quiet")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The options by section, as the docs group them: config.yaml is written in this order, a heading to each section
# (its keys stay flat: the YAML keys and flags are the same in every section). tests/test_config.py holds every
# field to exactly one section.
SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "init_from", "width", "depth", "heads", "activation", "dropout", "filters", "kernel",
              "lora", "lora_alpha", "lora_dropout", "lora_targets",
              "batchnorm", "memory_format", "precision", "compile", "activation_checkpointing", "selective_ac"),
    "data": ("dataset", "data_dir", "columns", "pack", "tokenizer", "context", "standardize", "target", "download",
             "val_size", "labels", "test_size", "image_size", "cache_dir", "skip_bad_images", "host_data",
             "random_crop", "crop_padding", "hflip", "brightness", "contrast", "test_flip"),
    "optimizer": ("optimizer", "lr", "momentum", "beta1", "beta2", "nesterov", "weight_decay", "clip_grad_norm",
                  "lr_schedule", "lr_decay_rate", "lr_decay_steps", "lr_decay_epochs", "lr_staircase",
                  "warmup_steps", "ema", "eval_ema", "loss", "label_smoothing", "metric"),
    "length": ("batch_size", "batch_per_worker", "accumulate", "eval_batch_size", "epochs", "steps", "max_time",
               "early_stopping", "seed"),
    "layout": ("accelerator", "strategy", "mesh", "tp_plan", "param_device", "devices", "threads_per_worker",
               "oversubscribe", "stages", "microbatches", "schedule", "split", "shard_modules",
               "reshard_after_forward", "shard_size", "cpu_offload"),
    "faults": ("max_restarts", "collective_timeout", "requeue_signal", "max_requeues"),
    "checkpoint": ("out", "resume", "overwrite", "checkpoint_every", "keep_checkpoints", "async_checkpoint"),
    "logging": ("log_every", "time_phases", "histogram_every", "tensorboard", "logger", "mlflow_uri", "experiment",
                "quiet"),
}


# Sizes that suit each dataset: the 1,437 digits need small batches to get enough steps.
def model_for_data(cfg: TrainConfig) -> TrainConfig:
    """The default model (lenet5, an image network) on data that is not images: the registry's network for it
    (gru for the token ids of tokens, gpt for text, mlp for the rest; a tensors file of token ids is told to name
    gru)."""
    if cfg.model != TrainConfig.model or cfg.dataset not in ("diabetes", "tokens", "tensors", "csv", "text",
                                                                    "jsonl"):
        return cfg
    return cfg.replace(model={"tokens": "gru", "text": "gpt", "jsonl": "gpt"}.get(cfg.dataset, "mlp"))


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds a tokenizer (a tokenizer's save_pretrained writes these files)."""
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_for_model(cfg: TrainConfig) -> TrainConfig:
    """A model named by its folder (hf:PATH) brings its folder's tokenizer to its text, where the folder holds one
    and no --tokenizer was given."""
    # (a run carried on keeps the tokenizer it began with: its config.yaml's, whatever the folder holds now)
    if not cfg.model.startswith(HF) or cfg.tokenizer != TrainConfig.tokenizer or cfg.dataset not in ("text", "jsonl") \
            or cfg.resume:
        return cfg
    folder = Path(cfg.model[len(HF):]).expanduser()
    return cfg.replace(tokenizer=str(folder.resolve())) if has_tokenizer(folder) else cfg


DATASET_DEFAULTS: dict[str, dict[str, int]] = {
    "digits": {"batch_size": 64, "epochs": 10},
    "mnist": {"batch_size": 512, "epochs": 5},
    "fashion-mnist": {"batch_size": 512, "epochs": 5},
    "kmnist": {"batch_size": 512, "epochs": 5},
    "cifar10": {"batch_size": 128, "epochs": 10},
    "cifar100": {"batch_size": 128, "epochs": 10},
    "synthetic": {"batch_size": 512, "epochs": 1},
    "imagefolder": {"batch_size": 64, "epochs": 10},
    "diabetes": {"batch_size": 32, "epochs": 100},
    "tokens": {"batch_size": 64, "epochs": 10},
    "tensors": {"batch_size": 64, "epochs": 10},
    "csv": {"batch_size": 64, "epochs": 10},
    "text": {"batch_size": 32, "epochs": 1},
    "jsonl": {"batch_size": 16, "epochs": 3},
    "custom": {"batch_size": 64, "epochs": 10},
}

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def loggers(cfg: TrainConfig) -> tuple[str, ...]:
    """The trackers a run writes: --logger's names ("none": none), tensorboard left out by --no-tensorboard."""
    named = tuple(n.strip() for n in cfg.logger.split(",") if n.strip() and n.strip() != "none")
    return tuple(n for n in named if n != "tensorboard" or cfg.tensorboard)


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
