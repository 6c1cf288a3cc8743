"""`paratrain export`: a run's weights as one plain state dict (torch.load(...) then model.load_state_dict(...)),
whatever strategy wrote its checkpoint (a sharded one is read whole, in this process); or, with --format
safetensors, as a folder that transformers' from_pretrained loads (a Hugging Face model's run) or that holds the
gpt's safetensors and config, written a file at a time (checkpoint/safetensors_folder.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's weights to one .pt file (a plain state dict) or a folder of "
                                      "safetensors")
    p.add_argument("run_dir", metavar="RUN", help="a run directory, or one of its checkpoints")
    p.add_argument("--out", required=True, metavar="FILE.pt|FOLDER", help="the file (pt) or folder (safetensors) "
                                                                          "to write")
    p.add_argument("--format", choices=("pt", "safetensors", "adapters"), default="pt",
                   help="pt: one state dict; safetensors: a folder as save_pretrained writes one, with the model's "
                        "config.json (from_pretrained loads that of a --model hf:PATH run; a --lora run's adapters "
                        "merged into its weights); adapters: a --lora run's adapters alone, as PEFT saves them")
    p.add_argument("--ema", action="store_true", help="the averaged weights (runs with --ema)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import files as checkpoint
    from ..core.errors import UserError

    out = Path(args.out)
    if out.is_dir() and args.format == "pt":
        raise UserError(f"--out {out} is a folder; name the file to write, e.g. {out / 'model.pt'}")
    state = checkpoint.load(args.run_dir, whole=args.format == "pt")  # (safetensors: read a file at a time)
    key = "ema_model" if args.ema else "model"
    averaged = state.get("ema_n_averaged") is not None if "sharded" in state else "ema_model" in state
    if args.ema and not averaged:
        raise UserError(f"{args.run_dir} has no averaged weights; it was trained without --ema (drop --ema)")
    if args.format == "adapters":
        return _adapters(state, key, out, args)
    if args.format == "safetensors":
        return _folder(state, key, out, args)
    weights = state[key]
    checkpoint.save(weights, out)
    count = sum(t.numel() for t in weights.values() if t.is_floating_point())
    model = state["config"].get("model")
    own = (state.get("parts") or {}).get("model")  # a network of the user's given to paratrain.fit
    what, build = (f"your network {own or ''}".rstrip(), f"paratrain.load_model('{args.run_dir}', model=make_net)") \
        if model == "custom" else (f"the {model} network", f"paratrain.load_model('{args.run_dir}')")
    if state["config"].get("lora"):  # its adapted layers' names: the network with the same adapters takes them
        what = f"{what} with its LoRA adapters (--format safetensors merges them into a plain {model})"
    print(f"paratrain: wrote {out}: {len(weights)} tensors, {count:,} weights, step {state['step']}"
          f"{' (EMA)' if args.ema else ''}, of {what}; load it into that network with "
          f"net.load_state_dict(torch.load('{out}')) ({build} builds it with them)")
    return 0


def _folder(state: dict[str, Any], key: str, out: Path, args: argparse.Namespace) -> int:
    """The safetensors folder, beside the Hugging Face folder's config.json (a --model hf:PATH run's) or the
    model's options as paratrain ran them (its model section)."""
    from ..checkpoint import safetensors_folder
    from ..core.import_path import HF, is_hf_folder
    from ..models.registry import MODEL_OPTIONS, options_unread

    cfg = state["config"]
    model = cfg.get("model")
    if is_hf_folder(model):
        config: Any = Path(model[len(HF):]) / "config.json"
        then = f"transformers' AutoModelForCausalLM.from_pretrained('{out}') loads it"
    else:  # the options that shape its network, as the flags that build it again take them
        shaping = {k: cfg.get(k) for k in (*MODEL_OPTIONS, "context")
                   if k not in options_unread(model) and cfg.get(k) is not None}
        config = {"paratrain_model": model, **shaping}
        flags = "".join(f" --{k} {v}" for k, v in shaping.items() if k != "dropout")
        then = f"paratrain train --model {model}{flags} --init-from {out} (with your --dataset) starts a run from it"
    merged = None
    if cfg.get("lora"):  # the adapters merged in: the model as transformers knows it
        from ..components.lora import Merged, alpha
        from ..config import from_dict

        merged = Merged(alpha(from_dict(cfg)) / cfg["lora"])
    count = safetensors_folder.write(state, key, out, config, merged)
    print(f"paratrain: wrote {out}: {count:,} weights in safetensors, step {state['step']}"
          f"{' (EMA)' if args.ema else ''}{', its adapters merged in' if merged else ''}; {then}")
    return 0


def _adapters(state: dict[str, Any], key: str, out: Path, args: argparse.Namespace) -> int:
    """A --lora run's adapters as PEFT saves them (adapter_model.safetensors, adapter_config.json): PEFT's
    PeftModel.from_pretrained(the base model, FOLDER) loads them."""
    from safetensors.torch import save_file

    from ..checkpoint import safetensors_folder
    from ..components.lora import adapters_of, peft_config
    from ..core.errors import UserError
    from ..core.import_path import HF, is_hf_folder
    from ..core.outputs import writing

    cfg = state["config"]
    if not cfg.get("lora"):
        raise UserError(f"{args.run_dir} was trained without --lora: it has no adapters; export it with --format "
                        "safetensors or pt")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; name a new folder to write the adapters in")
    shapes = safetensors_folder.sizes(state, key)
    names = adapters_of(shapes)
    read = safetensors_folder.tensors(state, key, {n: shapes[n] for n in names.values()})
    out.mkdir(parents=True, exist_ok=True)
    with writing(out / "adapter_model.safetensors"):
        save_file({peft: read[own] for peft, own in names.items()}, str(out / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    model = cfg.get("model", "")
    peft_config(cfg, shapes, model[len(HF):] if is_hf_folder(model) else None).save_pretrained(str(out))
    count = sum(t.numel() for t in read.values())
    print(f"paratrain: wrote {out}: {len(read)} adapters, {count:,} weights, step {state['step']}"
          f"{' (EMA)' if args.ema else ''}; PEFT's PeftModel.from_pretrained(the base model, '{out}') loads them")
    return 0
