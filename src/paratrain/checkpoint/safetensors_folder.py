"""A run's weights written as a folder of .safetensors files, as transformers' save_pretrained writes them (one
`model.safetensors`, or numbered files and `model.safetensors.index.json` beyond SHARD_BYTES), with the model's
config.json: `paratrain export RUN --format safetensors`. A sharded checkpoint's weights are read from its step
folder a file's worth at a time, so the exporting process never holds the whole model: one file at most."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UserError
from ..core.outputs import writing

SHARD_BYTES = 2 * 2**30  # a file's most (transformers' default is 5 GB; less keeps the export's peak down)
INDEX = "model.safetensors.index.json"


def sizes(state: dict[str, Any], part: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor of `part` ("model", "ema_model"): its shape and type, none read (a step folder's metadata)."""
    from . import dcp

    if "sharded" not in state:
        return {n: (tuple(t.shape), t.dtype) for n, t in state[part].items()}
    return dcp.tensors_of(state["sharded"], part)


def tensors(state: dict[str, Any], part: str,
            shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The tensors named in `shapes`: read together from a step folder (one file's worth), or copied from a whole
    file's state (safetensors refuses tensors that share memory, a tied head's)."""
    from . import dcp

    if "sharded" not in state:
        return {name: state[part][name].contiguous().clone() for name in shapes}
    into = {part: {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}}
    dcp.read(state["sharded"], into, distributed=False)
    return into[part]


def _files(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[list[str]]:
    """The names in files of SHARD_BYTES at most (a larger tensor alone in its file), in order."""
    files: list[list[str]] = [[]]
    held = 0
    for name, (shape, dtype) in shapes.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        if files[-1] and held + size > SHARD_BYTES:
            files.append([])
            held = 0
        files[-1].append(name)
        held += size
    return files


def write(state: dict[str, Any], part: str, out: Path, config: dict[str, Any] | Path, merge: Any = None) -> int:
    """The weights of `part` in folder `out` (created; refused where it holds files), beside `config` (a
    config.json to copy, or the dictionary to write as one). Returns the number of weights written. `merge`: how
    the written weights are made of the run's (a LoRA run's: each adapted weight with its adapters merged in;
    components/lora.Merged): `outputs(shapes)`, `sources(name)` and `combine(name, tensors)`."""
    from safetensors.torch import save_file

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; name a new folder to write the model in")
    if out.suffix in (".pt", ".pth", ".bin", ".safetensors"):
        raise UserError(f"--out {out}: --format safetensors writes a folder; name the folder (without {out.suffix})")
    if isinstance(config, Path) and not config.is_file():
        raise UserError(f"the run's model folder {config.parent} is gone (its config.json goes beside the weights); "
                        "put it back where the run found it, or export with --format pt")
    shapes = sizes(state, part)
    written = merge.outputs(shapes) if merge is not None else shapes
    files = _files(written)
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for file, members in zip(names, files, strict=True):
        read = tensors(state, part, {s: shapes[s] for n in members
                                     for s in (merge.sources(n) if merge is not None else [n])})
        made = {n: merge.combine(n, read) for n in members} if merge is not None else read
        with writing(out / file):
            save_file(made, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in members})
        total += sum(t.numel() * t.element_size() for t in made.values())
    if len(files) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if isinstance(config, Path):
        if (config.parent / "generation_config.json").is_file():
            shutil.copyfile(config.parent / "generation_config.json", out / "generation_config.json")
        config = json.loads(config.read_text())
        config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in config})  # what it holds now
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(torch.Size(s).numel() for s, d in written.values() if d.is_floating_point)
