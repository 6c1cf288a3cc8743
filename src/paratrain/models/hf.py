"""A Hugging Face model named by its folder (--model hf:PATH): built by transformers' AutoModelForCausalLM from the
folder's config.json alone, without network access. Its weights are drawn by transformers as it is built, or read
from the folder with --init-from (components/pretrained.py), each worker its own part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..core.import_path import HF
from ..core.optional import require


def folder_of(name: str) -> Path:
    """The folder `hf:PATH` names, checked to hold a config.json."""
    path = Path(name[len(HF):]).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"--model {name}: {path} holds no config.json; name a folder that save_pretrained wrote "
                        "(config.json beside its .safetensors files)")
    return path


PACKED_ATTENTION = ("sdpa", "eager", "flex_attention")  # the implementations that mask by transformers' masks


def check_packable(model: Any, name: str) -> None:
    """One line where a Hugging Face model would let packed examples see each other (--pack): transformers finds
    them from position_ids in its masks (masking_utils, since 4.54), which flash attention does not read for a
    batch of several rows."""
    import importlib

    import transformers

    try:  # (transformers before 4.48 has no masking_utils at all)
        found = hasattr(importlib.import_module("transformers.masking_utils"), "find_packed_sequence_indices")
    except ImportError:
        found = False
    if not found:
        raise UserError(f"--pack: transformers {transformers.__version__} does not keep packed examples apart by "
                        "their position_ids; pip install 'transformers>=4.54', or leave --pack out")
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if attention not in PACKED_ATTENTION:
        raise UserError(f"--pack: --model {name} runs {attention} attention, which keeps packed examples apart only in "
                        f"a batch of one row; give the folder a config with attn_implementation sdpa or eager, or "
                        "leave --pack out")


def from_folder(name: str) -> Any:
    """The causal language model that the config.json of folder `hf:PATH` describes."""
    path = folder_of(name)
    require("transformers", f"--model {name}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        # float32 weights whatever type the folder was saved in (the run's precision casts its computations)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--model {name}: transformers cannot build a causal language model from its config.json "
                        f"({first}); give the folder of one (LlamaForCausalLM, GPT2LMHeadModel, ...)") from None
