"""`paratrain export`: a run's weights as one plain state dict (torch.load(...) then model.load_state_dict(...)),
whatever strategy wrote its checkpoint (a sharded one is read whole, in this process)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's weights to one .pt file (a plain state dict)")
    p.add_argument("run_dir", metavar="RUN", help="a run directory, or one of its checkpoints")
    p.add_argument("--out", required=True, metavar="FILE.pt", help="the file to write")
    p.add_argument("--ema", action="store_true", help="the averaged weights (runs with --ema)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import files as checkpoint
    from ..core.errors import UserError

    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; name the file to write, e.g. {out / 'model.pt'}")
    state = checkpoint.load(args.run_dir)
    key = "ema_model" if args.ema else "model"
    if key not in state:
        raise UserError(f"{args.run_dir} has no averaged weights; it was trained without --ema (drop --ema)")
    weights = state[key]
    checkpoint.save(weights, out)
    count = sum(t.numel() for t in weights.values() if t.is_floating_point())
    model = state["config"].get("model")
    own = (state.get("parts") or {}).get("model")  # a network of the user's given to paratrain.fit
    what, build = (f"your network {own or ''}".rstrip(), f"paratrain.load_model('{args.run_dir}', model=make_net)") \
        if model == "custom" else (f"the {model} network", f"paratrain.load_model('{args.run_dir}')")
    print(f"paratrain: wrote {out}: {len(weights)} tensors, {count:,} weights, step {state['step']}"
          f"{' (EMA)' if args.ema else ''}, of {what}; load it into that network with "
          f"net.load_state_dict(torch.load('{out}')) ({build} builds it with them)")
    return 0
