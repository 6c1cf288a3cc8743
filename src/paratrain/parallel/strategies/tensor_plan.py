"""Which of a network's layers tensor parallelism splits, and how: a plan, a mapping of module-name patterns
(`*` for any one name, as in `layers.*.mlp.up`) to a style. The vocabulary is Hugging Face's, so a model's own
plan reads as it is:

    colwise                 a Linear's outputs split over the workers (its weight by rows), the input whole
    rowwise                 a Linear's inputs split (its weight by columns), the outputs summed (all-reduce);
                            on an Embedding: its table split by vocabulary, the looked-up rows summed
    colwise_rep             colwise, the outputs gathered whole (also colwise_gather_output)
    embedding_rowwise       rowwise on an Embedding (the same as rowwise there)
    colwise_shard_output    colwise, the outputs left split as a DTensor: for a head whose loss is computed on
                            the split scores (torch's loss_parallel), never gathering the vocabulary

Sequence parallelism (the norms' activations split along the sequence) is not among them: it needs every
neighbouring layer's layouts to match, and saves memory rather than time at the sizes it runs here.

A layer with LoRA adapters (components/lora.py: its own Linear under `base_layer`, beside A and B) is split as the
layer would be, its adapters with it: colwise splits the layer and B by outputs (A's input is whole, and its
rank-sized output too); rowwise splits the layer and A by inputs (the layer's partial outputs and A's summed by
their all-reduces), B whole. Each worker then adds its own part of B(A(x)) to its own part of the layer's output.

Where a plan comes from, in order: a YAML file (--tp-plan), a `tp_plan` attribute of the network (a dict, the
Python way), a Hugging Face model's own (`_tp_plan`, from its config's `base_model_tp_plan`), the built-in gpt's.
A network with none is refused in one line. Colwise then rowwise inside a block leaves each worker its own heads
and hidden units with no exchange between the two; a block's two all-reduces are the output projections'.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from torch import nn

from ...core.errors import UserError

STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "embedding_rowwise",
          "colwise_shard_output")


def of_gpt(model: nn.Module) -> dict[str, str]:
    """The built-in gpt's: the embeddings by vocabulary, q/k/v and the MLP's first projection by columns,
    the output projections by rows, the head by vocabulary with its scores left split for the loss."""
    from ...models.gpt import shape as gpt_shape

    depth = gpt_shape(model)["depth"]
    plan = {"0.tokens": "rowwise"}  # the positions' table is small and every worker needs all of it: whole
    for i in range(1, depth + 1):
        plan |= {f"{i}.attention.{n}": "colwise" for n in ("query", "key", "value")}
        plan |= {f"{i}.attention.out": "rowwise", f"{i}.mlp.up": "colwise", f"{i}.mlp.down": "rowwise"}
    plan[str(depth + 2)] = "colwise_shard_output"
    return plan


def read_yaml(path: str) -> dict[str, str]:
    """--tp-plan FILE: a YAML mapping of module-name patterns to styles."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--tp-plan {path}: no such file; give a YAML file of module-name patterns to styles "
                        "(e.g. 'layers.*.up: colwise')")
    try:
        plan = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"--tp-plan {path} is not YAML ({str(e).splitlines()[0]})") from None
    if isinstance(plan, dict):  # an unquoted module name of digits (a Sequential's "1") reads as a number
        plan = {str(k) if isinstance(k, int) else k: v for k, v in plan.items()}
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise UserError(f"--tp-plan {path}: give a mapping of module-name patterns to styles, e.g. "
                        "'layers.*.up: colwise'")
    return plan


def plan_of(model: nn.Module, path: str | None) -> dict[str, str]:
    """The plan that splits `model` (checked: known styles, every pattern naming some module)."""
    from ...models.gpt import GPT

    if path:
        plan, source = read_yaml(path), f"--tp-plan {path}"
    elif isinstance(getattr(model, "tp_plan", None), dict):
        plan, source = model.tp_plan, "the network's tp_plan"
    elif getattr(model, "_tp_plan", None):  # a Hugging Face model's, from its config's base_model_tp_plan
        plan, source = dict(model._tp_plan), "the model's own plan (its config's base_model_tp_plan)"
    elif isinstance(model, GPT):
        plan, source = of_gpt(model), "the gpt's"
    else:
        raise UserError(f"tensor parallelism needs a plan for {type(model).__name__}: give --tp-plan FILE.yaml (in "
                        "Python, a tp_plan attribute of the network), a mapping of module names to colwise/rowwise, "
                        "e.g. 'layers.*.up: colwise'; or use --strategy fsdp")
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        if style not in STYLES:
            raise UserError(f"{source}: '{pattern}: {style}' is not a style; use one of {', '.join(STYLES)}")
        if not any(_matches(n, pattern) for n in names):
            raise UserError(f"{source}: '{pattern}' names no module of {type(model).__name__}")
    return plan


def _matches(name: str, pattern: str) -> bool:
    """Whether module `name` is one `pattern` names: `*` stands for one name between dots."""
    return name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern)


def _style(style: str, module: nn.Module) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style in ("rowwise", "embedding_rowwise"):
        # an Embedding's input is token ids, whole on every worker (a Linear's rowwise input is already split)
        return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "colwise_shard_output":
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel()


def apply(module: nn.Module, mesh: Any, plan: dict[str, str]) -> nn.Module:
    """`module` split over the 1-D `mesh` by `plan`, for the modules it has (a pipeline stage holds some of
    the model's: it keeps their names)."""
    from torch.distributed.tensor.parallel import parallelize_module

    named = {name: style for pattern, style in plan.items() for name, _ in module.named_modules()
             if name and _matches(name, pattern)}
    modules = dict(module.named_modules())
    styles = {part: _style(style, modules[part]) for name, style in named.items()
              for part, style in _parts(name, modules[name], style).items()}
    return parallelize_module(module, mesh, styles) if styles else module


ADAPTED = {"colwise": "lora_B", "rowwise": "lora_A"}  # the adapter split with an adapted layer, by its style


def _parts(name: str, module: nn.Module, style: str) -> dict[str, str]:
    """The modules that `style` on module `name` splits: the module; or an adapted layer's own Linear and the
    adapter split with it (the module docstring)."""
    if getattr(module, "base_layer", None) is None or style not in ADAPTED:  # (check_splits refuses the others)
        return {name: style}
    adapter = ADAPTED[style]
    return {f"{name}.base_layer": style, **{f"{name}.{adapter}.{k}": style for k in getattr(module, adapter)}}


def check_splits(model: nn.Module, plan: dict[str, str], tp: int, source: str = "the plan") -> None:
    """One line, before any worker starts, where the plan names a module tensor parallelism cannot split, or
    one whose split size tp does not divide."""
    for name, sub in model.named_modules():
        style = next((v for k, v in plan.items() if name and _matches(name, k)), None)
        if style is None:
            continue
        if getattr(sub, "base_layer", None) is not None:  # a layer with LoRA adapters: split with its adapters
            if style not in ADAPTED:
                raise UserError(f"{source}: '{name}' has LoRA adapters, which tp splits with a colwise or rowwise "
                                f"layer, not {style}: leave it out of --lora-targets")
            sub = sub.base_layer
        if not isinstance(sub, nn.Linear | nn.Embedding):
            raise UserError(f"{source}: '{name}' is a {type(sub).__name__}; {style} splits a Linear or an Embedding: "
                            "name those")
        if isinstance(sub, nn.Embedding):
            size, what = sub.num_embeddings, "rows (its vocabulary)"
        elif style.startswith("colwise"):
            size, what = sub.out_features, "outputs"
        else:
            size, what = sub.in_features, "inputs"
        if size % tp:
            raise UserError(f"tp={tp} does not divide the {size} {what} of '{name}' ({type(sub).__name__}, "
                            f"{style}); use a tp that divides {size}")


def splits_output(plan: dict[str, str]) -> bool:
    """Whether the model's scores come out split over the workers (a loss_parallel head)."""
    return "colwise_shard_output" in plan.values()


def shape(model: nn.Module) -> dict[str, int]:
    """What tensor parallelism must divide: the heads, key/value heads, width, hidden units, vocabulary."""
    from ...models.gpt import shape as gpt_shape

    gpt = gpt_shape(model)
    if gpt is not None:
        return {k: gpt[k] for k in ("heads", "width", "hidden", "vocabulary")}
    config = getattr(model, "config", None)
    found = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "width": "hidden_size",
             "hidden": "intermediate_size", "vocabulary": "vocab_size"}
    return {k: getattr(config, v) for k, v in found.items() if isinstance(getattr(config, v, None), int)}
