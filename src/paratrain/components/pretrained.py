"""Weights a run starts from instead of drawing them (--init-from): a Hugging Face model folder (config.json and
.safetensors files, as save_pretrained writes them) or a paratrain run (its newest checkpoint). The model is built
on the meta device and laid out as every run's is; then each worker reads only its part of each weight, through
torch.distributed.checkpoint (DCP's Hugging Face reader for a folder's safetensors, its own for a run's step
folder), which reads the pieces a worker's shards cover. What the source holds is checked against the model before
any process starts: names and shapes, one line naming the first few that differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import UserError
from ..core.optional import require
from .initial import materialised
from .lora import is_adapter, plain_name

SHOWN = 3  # the names a mismatch lists


class Pretrained:
    """The weights in `path`: a Hugging Face folder (`hf`) or a paratrain step folder (`dcp`)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self._shapes: dict | None = None
        self.adapters: Any = None  # a LoRA run's adapters' initial weights (initial.Initial): no folder holds them

    @classmethod
    def of(cls, given: str) -> Pretrained:
        """The source --init-from names, or one line that says what it lacks."""
        path = Path(given).expanduser()
        if not path.exists():
            raise UserError(f"--init-from {given}: no such file or folder")
        if path.is_dir() and (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")):
                raise UserError(f"--init-from {given}: its config.json has no .safetensors files beside it; save the "
                                "model with save_pretrained (safetensors, transformers' default)")
            return cls(path, "hf")
        from ..checkpoint import dcp
        from ..checkpoint.run_folder import step_checkpoints
        from ..core.run_paths import RunPaths

        if dcp.is_sharded(path):
            return cls(path, "dcp")
        steps = [p for _, p in step_checkpoints(RunPaths(path).checkpoints)] if path.is_dir() else []
        if steps and dcp.is_sharded(steps[-1]):
            return cls(steps[-1], "dcp")
        raise UserError(f"--init-from {given}: neither a Hugging Face model folder (config.json and .safetensors "
                        "files) nor a paratrain run with a checkpoint; give one of those")

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each weight the source holds: its shape and type, read from the files' headers (no tensor read) once;
        a file whose header or size is not whole is one line naming it."""
        if self._shapes is None:
            self._shapes = self._read_shapes()
        return self._shapes

    def _read_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.kind != "hf":
            from ..checkpoint import dcp

            try:
                return dcp.tensors_of(self.path, "model")
            except Exception as e:  # noqa: BLE001 (a damaged checkpoint's metadata)
                raise UserError(f"--init-from {self.path}: its weights cannot be read ({type(e).__name__}: "
                                f"{str(e)[:160]}); is the checkpoint whole?") from None
        require("safetensors", "--init-from a Hugging Face model folder")
        from safetensors import safe_open

        found = {}
        for file in sorted(self.path.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                        piece = f.get_slice(name)
                        found[name] = (tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype()))
            except Exception as e:  # noqa: BLE001 (safetensors' own errors: a header cut short or damaged)
                raise UserError(f"--init-from {self.path}: {file.name} is damaged or cut short ({str(e)[:120]}); "
                                "save the model again, or copy the file whole") from None
        return found

    def check(self, model: nn.Module) -> None:
        """The source against `model` (built on the meta device): every weight there, of its shape, in a floating
        type; a UserError naming the first few that are not."""
        held = self.shapes()
        wanted, aliases = _sourced(model, held), {plain_name(n) for n in _aliases(model)}
        missing = [n for n in wanted if n not in held]
        if missing:
            raise UserError(f"--init-from {self.path}: it lacks {_few(missing)} of this model's {len(wanted)} "
                            f"weights (it holds {_few(list(held))}): these are another model's weights; give the "
                            "folder of this model's, or --model hf:FOLDER for theirs")
        unknown = [n for n in held if n not in wanted and n not in aliases]
        if unknown:
            raise UserError(f"--init-from {self.path}: it holds {_few(unknown)}, which this model does not have: "
                            "these are another model's weights; give the folder of this model's")
        wrong = [f"{n} {held[n][0]} (the model's {tuple(t.shape)})" for n, t in wanted.items()
                 if held[n][0] != tuple(t.shape)]
        if wrong:
            raise UserError(f"--init-from {self.path}: shapes differ: {_few(wrong)}; build the model these "
                            "weights were saved from (its --model hf:FOLDER, or the --width, --depth, --heads and "
                            "--context of the run that saved them)")
        odd = [f"{n} ({held[n][1]})" for n, t in wanted.items()  # (an integer buffer, a counter, is read as it is)
               if t.is_floating_point() and (held[n][1] is None or not held[n][1].is_floating_point)]
        if odd:
            raise UserError(f"--init-from {self.path}: weights in a type the run cannot train: {_few(odd)} "
                            "(quantized or integer); give float32, bfloat16 or float16 weights")

    def fill(self, model: nn.Module, device: torch.device) -> nn.Module:
        """`model` (laid out, on the meta device) on `device`, each worker reading its part of every weight."""
        import torch.distributed as dist

        from ..checkpoint import dcp

        materialised(model, device)  # (a model built whole, as some networks must be, moved there)
        held = self.shapes()
        into, distributed = _sourced(model, held), dist.is_available() and dist.is_initialized()
        if self.kind == "hf":
            dcp.read_folder(self.path, into, distributed)
        else:
            dcp.read(self.path, {"model": into}, distributed)
        if self.adapters is not None:  # those the source lacks drawn from the seed, as a run without it draws them
            self.adapters.draw(model, lambda n: is_adapter(n) and n not in held)
        return model


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def _wanted(model: nn.Module) -> dict[str, Any]:
    """The model's weights and saved buffers by name, a tensor two names share under its first (a tied head:
    save_pretrained keeps it once)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _sourced(model: nn.Module, held: dict[str, Any]) -> dict[str, Any]:
    """The model's weights a source gives, by the name the source has for each: its own, or, under LoRA, the name
    without its adapted layer's `.base_layer` (a pretrained folder's); the adapters' own are no source's."""
    return {n if n in held else plain_name(n): t for n, t in _wanted(model).items()
            if not (is_adapter(n) and n not in held)}


def _aliases(model: nn.Module) -> set[str]:
    return set(model.state_dict(keep_vars=True)) - set(_wanted(model))


def _few(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
