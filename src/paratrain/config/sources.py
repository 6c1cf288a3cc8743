"""Where a configuration's values come from: a dict (a recipe, a --config file), a run's config.yaml, the
layers put one on another (config.overlay), and the run folder's name."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import UserError
from ..core.import_path import HF, is_import_path
from ..core.outputs import write_atomic
from ..core.run_paths import RunPaths
from ..runtime.env import LOCAL, Environment
from .fields import FIELDS, SECTIONS, TrainConfig, _coerce, did_you_mean, model_for_data, shown


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
    saved = RunPaths(run).config
    if not Path(run).exists():
        raise UserError(f"{given_as}: there is no such folder; pass the directory of a paratrain run")
    if not saved.is_file():
        raise UserError(f"{given_as}: no config.yaml there; pass the directory of a paratrain run")
    values = load_yaml(saved)
    values.pop("quiet", None)  # how a command shows progress is its own (a search's trials ran quiet)
    values.pop("init_from", None)  # where it started from: a run carried on starts from its own checkpoint
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


def with_run_dir(cfg: TrainConfig, env: Environment = LOCAL) -> TrainConfig:
    """The run directory: a resumed run's own folder, the given --out, or runs/<model>-<dataset>-<time> (in a
    Slurm job (`env`) runs/<model>-<dataset>-job<id>[.<step>]: the same in every task and every start of a
    requeued job, and apart for each srun of the job's script after its first)."""
    if cfg.resume:
        return cfg.replace(out=cfg.resume)
    if cfg.out:
        return cfg
    job = env.slurm
    when = job_tag(job.name, job.step) if job else time.strftime('%Y%m%d-%H%M%S')
    return cfg.replace(out=default_run_dir(model_for_data(cfg), when))


def job_tag(name: str, step: int | None) -> str:
    """A Slurm job's part of its default run folder: job<name>, and .<step> for an srun after the script's first."""
    return f"job{name}{f'.{step}' if step else ''}"


def default_run_dir(cfg: TrainConfig, when: str) -> str:
    """runs/<model>-<dataset>-<when>."""
    model = cfg.model
    if model.startswith(HF):  # hf:path/to/folder -> hf-folder
        model = "hf-" + Path(model[len(HF):]).name
    elif is_import_path(model):  # path/to/net.py:build -> net.build (a folder name, not a path)
        head, _, tail = model.rpartition(":")
        model = f"{Path(head).stem if head.endswith('.py') else head.rsplit('.', 1)[-1]}.{tail}"
    return str(Path("runs") / f"{model}-{cfg.dataset}-{when}")


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


def save_yaml(cfg: TrainConfig, path: str | Path, unread: Iterable[str] = ()) -> None:
    """config.yaml: the options by section (fields.SECTIONS), a heading to each, its keys flat as --config takes
    them; `unread`, the options the run's model and layout do not read, left out (read back, they take their
    defaults, which nothing reads either)."""
    values, unread = cfg.to_dict(), set(unread)
    # both are recorded (a resume with --epochs drops the steps: overlay), but only one sets the length
    text = "# steps is set: it is the run's length, and epochs is not read\n" if cfg.steps is not None else ""
    for section, names in SECTIONS.items():
        kept = {name: values[name] for name in names if name not in unread}
        if kept:
            text += f"# {section}\n" + yaml.safe_dump(kept, sort_keys=False)
    write_atomic(Path(path), text)
