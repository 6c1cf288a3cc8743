"""Low-rank adapters (--lora RANK): PEFT's LoRA put into the model as it is built (on the meta device, like the
rest), its own weights frozen. Each adapted layer computes base(x) + B(A(dropout(x))) x alpha / rank, where A
(rank x in) and B (out x rank) are the only weights trained.

- PEFT injects the adapters in place (`inject_adapter_in_model`: no wrapper around the model), so the model keeps
  its forward and its names, but for each adapted layer's weights, now under `.base_layer.` (`plain_name` takes
  them back to the names a pretrained folder holds).
- A is drawn as PEFT draws it (Kaiming-uniform, as torch's Linear draws its weight) and B starts at zero, so the
  adapted model starts as the model: B's layer draws zeros (`ZeroStart`), and initial.py draws every adapter
  module by module from the seed as it draws the rest, the same on one device and on every layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..core.errors import UserError
from ..core.optional import require

BASE = ".base_layer"  # where PEFT puts an adapted layer's own weights
ADAPTER = "default"  # the one adapter's name (PEFT's default)


class ZeroStart(nn.Linear):
    """LoRA's B: a Linear that starts at zero, so that an adapted layer starts as the layer itself."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def alpha(cfg: TrainConfig) -> float:
    return cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora


def adapted(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """`model` with LoRA adapters of rank --lora in the layers --lora-targets names, every other weight frozen
    (requires_grad False); `model` as it is where --lora is 0."""
    if not cfg.lora:
        return model
    require("peft", "--lora")
    from peft import LoraConfig, inject_adapter_in_model

    targets: Any = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
        [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    if targets == "all-linear" and not callable(getattr(model, "get_output_embeddings", None)):
        # PEFT leaves a transformers model's output head out; a network of ours or yours: its last linear layer
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if len(linear) < 2:
            raise UserError("--lora: the model has no linear layer but its output to adapt; name them with "
                            "--lora-targets")
        targets = linear[:-1]
    config = LoraConfig(r=cfg.lora, lora_alpha=alpha(cfg), lora_dropout=cfg.lora_dropout, target_modules=targets,
                        bias="none")
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT's: no layer of those names, or of a kind it cannot adapt
        first = (str(e).strip().splitlines() or ["?"])[0][:200]
        raise UserError(f"--lora-targets {cfg.lora_targets}: PEFT cannot adapt them ({first}); name linear layers "
                        "of the model (q_proj,v_proj, ...), or all-linear") from None
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and not isinstance(base, nn.Linear):  # (merging and the zero start are a Linear's)
            raise UserError(f"--lora adapts linear layers (nn.Linear), and '{name}' is a {type(base).__name__}; "
                            "name linear layers with --lora-targets")
        if name.endswith(f".lora_B.{ADAPTER}") and type(module) is nn.Linear:  # (built whole: PEFT's zeros)
            module.__class__ = ZeroStart
    return model


def is_adapter(name: str) -> bool:
    """Whether weight `name` is an adapter's (LoRA's A or B), which no pretrained folder holds."""
    return ".lora_A." in name or ".lora_B." in name


def plain_module(path: str) -> str:
    """The path module `path` of an adapted model has in the model without adapters (an adapted layer's own)."""
    return path[: -len(BASE)] if path.endswith(BASE) else path


def plain_name(name: str) -> str:
    """The name weight `name` of an adapted model has in the model without adapters (a pretrained folder's)."""
    return name.replace(BASE + ".", ".")


class Merged:
    """A LoRA run's weights as the model without adapters holds them, each adapted weight W made W + scale x B A
    (what transformers loads; safetensors_folder.write reads each with its adapters, a file's worth at a time)."""

    def __init__(self, scale: float) -> None:
        self.scale, self.by_plain = scale, {}

    def outputs(self, shapes: dict[str, Any]) -> dict[str, Any]:
        self.by_plain = {plain_name(n): n for n in shapes if not is_adapter(n)}
        return {p: shapes[n] for p, n in self.by_plain.items()}

    def sources(self, name: str) -> list[str]:
        own = self.by_plain[name]
        if not own.endswith(BASE + ".weight"):
            return [own]
        layer = own[: -len(BASE + ".weight")]
        return [own, f"{layer}.lora_A.{ADAPTER}.weight", f"{layer}.lora_B.{ADAPTER}.weight"]

    def combine(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        own, *adapters = self.sources(name)
        if not adapters:
            return tensors[own]
        a, b = (tensors[n] for n in adapters)
        return tensors[own] + (b @ a) * self.scale  # (as PEFT merges them)


def adapters_of(shapes: dict[str, Any]) -> dict[str, str]:
    """The adapters' weights of a LoRA run by the names PEFT's saved adapters have ("base_model.model.<layer>.lora_A
    .weight", its adapter's name left out)."""
    return {"base_model.model." + n.replace(f".{ADAPTER}.", "."): n for n in shapes if is_adapter(n)}


def peft_config(cfg: dict[str, Any], shapes: dict[str, Any], base: str | None) -> Any:
    """PEFT's LoraConfig of a run (its configuration as config.yaml holds it), adapting the layers it adapted."""
    from peft import LoraConfig

    layers = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in shapes if ".lora_A." in n})
    from ..config import from_dict

    run = from_dict(cfg)
    return LoraConfig(r=run.lora, lora_alpha=alpha(run), lora_dropout=run.lora_dropout, target_modules=layers,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base)
