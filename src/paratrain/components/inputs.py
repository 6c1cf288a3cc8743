"""The data of a run from what the caller gave: a dataset's name (its files, read by data/), an image folder,
a torch Dataset (decoded once into a cache), a Splits, or a dict of tensors."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from .. import config as C
from ..core.errors import UserError, closest
from ..core.run_paths import RunPaths
from ..data import Splits, folder, load_dataset
from ..data.dataset import from_dataset
from ..data.tables import from_items, is_tensors_item
from ..data.tensors import tensor_splits
from ..data.transforms import unit_scale
from ..models import native_channels

DataLike = str | os.PathLike | Splits | dict[str, tuple[torch.Tensor, torch.Tensor]] | torch.utils.data.Dataset


def load_for(cfg: C.TrainConfig) -> Splits:
    """The dataset a training configuration names, shaped for its model (the synthetic images take the
    model's native channels)."""
    if cfg.dataset == "text":  # a UTF-8 file or folder, tokenized once into a memory-mapped cache
        from ..data import text

        return text.load(cfg.data_dir, cfg.context, cfg.tokenizer, cfg.val_size, cfg.test_size, cfg.cache_dir,
                         cfg.quiet)
    if cfg.dataset == "jsonl":  # instruction or chat examples, their prompts' targets not counted
        from ..data import instructions

        return instructions.load(cfg.data_dir, cfg.context, cfg.tokenizer, cfg.val_size, cfg.test_size, cfg.columns,
                                  pack=cfg.pack)
    if cfg.dataset in ("tensors", "csv"):  # files of tensors or a table (config.validate: they name one)
        from ..data import tables

        if cfg.dataset == "csv":
            return tables.load_csv(cfg.data_dir, cfg.target, cfg.val_size, cfg.test_size)
        return tables.load_tensors(cfg.data_dir, cfg.val_size, cfg.test_size)
    if cfg.dataset == "imagefolder":
        if not cfg.data_dir:
            raise UserError("--dataset imagefolder needs --data-dir DIR, a folder with a sub-folder of images per "
                            "class")
        return folder.load(cfg.data_dir, cfg.image_size, cfg.val_size, cfg.test_size, cfg.cache_dir,
                           cfg.skip_bad_images, quiet=cfg.quiet)
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.download, cfg.val_size, native_channels(cfg.model),
                        cfg.labels, cfg.test_size)


def file_kind(data: Any, dataset: str) -> str | None:
    """The dataset a path given as data names by its suffix (a CSV table, an .npz of tensors), or the
    configuration's "tensors" or "csv" for any path; None: not such a file."""
    if not isinstance(data, str | os.PathLike) or (isinstance(data, str) and data in C.DATASETS):
        return None
    suffix = Path(data).suffix.lower()
    return {".csv": "csv", ".npz": "tensors"}.get(suffix) or (dataset if dataset in ("tensors", "csv") else None)


def is_folder(data: Any) -> bool:
    """`data` names an image folder (a path), not a dataset."""
    return isinstance(data, os.PathLike) or (isinstance(data, str) and data not in C.DATASETS and
                                             ("/" in data or os.sep in data or Path(data).is_dir()))


def as_splits(data: DataLike, cfg: C.TrainConfig, cache_key: str | None = None, in_group: bool = False) -> Splits:
    """The training, validation and test sets as a `Splits` (normalised with the training set's statistics).
    `in_group`: this process is one of a launcher's ranks (torchrun), which share a Dataset's cache."""
    if isinstance(data, Splits):
        return data
    if isinstance(data, str):
        return load_for(cfg if cfg.dataset in C.FILES else cfg.replace(dataset=data))
    if isinstance(data, torch.utils.data.Dataset) and len(data) and is_tensors_item(data[0]):  # type: ignore[arg-type]
        if cache_key is not None:
            raise UserError("cache_key names the decoded cache of a Dataset of images; a Dataset of tensors is read "
                            "into memory: leave cache_key out")
        return from_items(data, cfg.val_size, cfg.test_size)  # examples of tensors: read into memory
    if isinstance(data, torch.utils.data.Dataset):  # decoded once into a cache: the run's, or one the user names
        if cache_key is not None:
            where, reuse = folder.dataset_cache(cache_key, cfg.cache_dir, cfg.image_size), True
        else:  # torchrun's ranks (fresh or not) share what the first one built
            where, reuse = RunPaths(cfg.out).data_cache, bool(cfg.resume) or in_group
        return from_dataset(data, where, cfg.image_size, cfg.val_size, cfg.test_size, reuse=reuse, quiet=cfg.quiet)
    if not isinstance(data, dict):
        raise UserError(f"data must be a dataset name, an image folder's path, a torch Dataset of (image, label) "
                        f"pairs, a Splits, or a dict with 'train', 'val' and 'test' (inputs, targets) pairs; not a "
                        f"{type(data).__name__}")
    _check_splits(data)
    if any(_named(data[name]) for name in ("train", "val", "test")):
        return tensor_splits({name: _columns(data[name], name) for name in ("train", "val", "test")})
    for name in ("train", "val", "test"):
        pair = data[name]
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
            raise UserError(f"data['{name}'] must be an (inputs, targets) pair of torch tensors (numpy arrays: "
                            "torch.from_numpy(a)), or named columns (a dict with 'input_ids' and 'labels')")
    if not _images(data):
        x, y = data["train"]
        if x.dim() == 4 and x.shape[2] == x.shape[3] and y.dim() == 1 and y.is_floating_point() and not cfg.quiet:
            print("paratrain: note: the labels are floats, so this is a regression (mean squared error) and the "
                  "images go to the network as tensors, unnormalised; give integer labels (labels.long()) to "
                  "classify them", file=sys.stderr, flush=True)
        return tensor_splits({name: tuple(data[name]) for name in ("train", "val", "test")})
    x = data["train"][0]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[2] != x.shape[3] or not len(x):
        raise UserError("data['train'] images must be a non-empty tensor of square images N x C x H x H; got "
                        f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    pairs = {}
    for name in ("train", "val", "test"):
        images, labels = data[name]
        if images.dim() != 4 or images.shape[1:] != x.shape[1:] or labels.dim() != 1 or len(images) != len(labels):
            raise UserError(f"data['{name}']: images must be N x C x H x W like the training images, with one "
                            f"label each; got {tuple(images.shape)} and labels of shape {tuple(labels.shape)}")
        if labels.is_floating_point() or labels.is_complex() or (len(labels) and int(labels.min()) < 0):
            raise UserError(f"data['{name}']: labels must be integers 0..K-1 (class indices)")
        pairs[name] = (images, labels.long())
    unit = unit_scale(x).double()  # float64: statistics that do not depend on the thread count's sum order
    mean, std = unit.mean(dim=(0, 2, 3)), unit.std(dim=(0, 2, 3))
    classes = max(int(p[1].max()) for p in pairs.values() if len(p[1])) + 1
    return Splits("custom", pairs["train"], pairs["val"], pairs["test"], tuple(mean.tolist()), tuple(std.tolist()),
                  classes)


def _check_splits(data: dict) -> None:
    missing = [k for k in ("train", "val", "test") if k not in data]
    if missing:
        extra = [str(k) for k in data if k not in ("train", "val", "test")]
        meant = next(((k, m) for k in extra if (m := closest(k, missing))), None)
        hint = f" (is '{meant[0]}' meant to be '{meant[1]}'?)" if meant else ""
        raise UserError(f"data has no {', '.join(repr(k) for k in missing)}{hint}; give a dict with 'train', 'val' "
                        "and 'test' (inputs, targets) pairs (a validation set may hold zero examples)")


def _named(split: Any) -> bool:
    """A split given as named columns: a dict of tensors (with "labels"), or an (inputs, targets) pair whose
    inputs are a dict of tensors."""
    from collections.abc import Mapping

    return isinstance(split, Mapping) or (isinstance(split, tuple | list) and len(split) == 2 and
                                          isinstance(split[0], Mapping))


def _columns(split: Any, name: str) -> tuple[Any, torch.Tensor]:
    """A split of named columns as (inputs, targets): a dict's "labels" are its targets, and the network is
    given them too (a Hugging Face model computes its own loss from them, shifted as it does); a pair's
    inputs are the dict, its targets the second tensor."""
    from collections.abc import Mapping

    from ..data.columns import Columns

    inputs, targets = (split, split.get("labels")) if isinstance(split, Mapping) else split
    where = f"data['{name}']"
    if not _named(split) or targets is None:
        raise UserError(f"{where} must be named columns like the other splits: a dict of tensors with 'labels' "
                        "(input_ids, attention_mask, labels), or an (inputs dict, targets) pair")
    if not inputs or not all(isinstance(v, torch.Tensor) for v in inputs.values()) or \
            not isinstance(targets, torch.Tensor):
        raise UserError(f"{where}: every column must be a torch tensor, one row an example (pad sequences to one "
                        "length, with an attention_mask)")
    lengths = {k: len(v) for k, v in inputs.items()}
    if len(set(lengths.values()) | {len(targets)}) != 1:
        raise UserError(f"{where}: the columns have unequal rows ({lengths}); give every column a row an example")
    return Columns(dict(inputs)), targets


def _images(data: dict[str, Any]) -> bool:
    """Images with class labels: square N x C x H x H inputs (uint8, or floats in 0..1) and one integer label
    each, which get everything images get (normalisation, augmentation, the image networks). Anything else is
    tensors (tensor_splits)."""
    x, y = data["train"]
    return x.dim() == 4 and x.shape[2] == x.shape[3] and y.dim() == 1 and not y.is_floating_point() and \
        not y.is_complex() and y.dtype != torch.bool
