"""`paratrain train`: one training run (session.run does the work)."""

from __future__ import annotations

import argparse
import sys

from .. import config as C
from ..core.errors import UserError
from ..core.outputs import check_writable
from ..parallel.requeue import signal_for
from ..parallel.strategies import checked
from ..runtime import prefork
from ..runtime.env import detect
from .parser import add_train_flags


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with data (replicated or sharded), pipeline or hybrid parallelism")
    add_train_flags(p)
    p.add_argument("--print-split", action="store_true",
                   help="pipeline/hybrid: show the stages, their parameters and counted cost, and exit")
    p.set_defaults(run=run)


def resolve_config(args: argparse.Namespace) -> C.TrainConfig:
    """dataclass defaults <- the resumed run's config or a recipe <- --config YAML <- flags, each layer put on
    the one below by config.overlay (a length or decay period in one unit drops the lower layer's other)."""
    from ..config import recipes
    from ..parallel.mesh import parse as parse_mesh
    from ..parallel.mesh import strategy_for
    from ..parallel.strategies import carried_to

    base = C.TrainConfig()
    if args.resume:
        C.check_resume_out(args.resume, args.out, f"--out {args.out}")
        base = C.of_run(args.resume, f"--resume {args.resume}")
        if args.mesh is not None:  # the mesh decides the strategy, its stages, cuts and workers
            base = carried_to(base, strategy_for(parse_mesh(args.mesh))["strategy"])
            base = base.replace(strategy=C.TrainConfig.strategy, stages=None, split=C.TrainConfig.split,
                                shard_size=None, devices="auto")
        elif args.strategy is not None:  # carried on by another strategy: the old one's own options stay behind
            base = carried_to(base, args.strategy)
    elif args.recipe:
        base = C.from_dict(recipes.load(args.recipe))
    values = C.load_yaml(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in C.FIELDS if getattr(args, name) is not None}
    keys = C.changed(C.from_dict(values)) - set(flags)  # the file's own settings (not its copies of the defaults)
    env = getattr(args, "env", None) or detect()  # main's, detected once (a caller's namespace may lack it)
    cfg = checked(C.validate(C.with_run_dir(C.overlay(C.overlay(base, values), flags), env)))
    C.check_read(cfg, flags)
    # a file may come from elsewhere (another run's config.yaml): what it sets in vain is a warning
    said = [f"{C.in_python_words(clause)}, in {args.config}; it is ignored" for clause in C.unread(cfg, keys).values()]
    if {"lr_decay_steps", "lr_decay_epochs"} <= keys:
        said.append(f"lr_decay_steps and lr_decay_epochs are both set: the steps are the decay period, in "
                    f"{args.config}")
    if env.is_main:  # once, not once per rank
        for line in said:
            print(f"paratrain: warning: {line}", file=sys.stderr, flush=True)
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    env = args.env  # main's: detected once per process
    from ..parallel import strategies

    if prefork.forks_for(cfg.devices, strategies.get(cfg.strategy).one_process, env.in_group) and not args.print_split:
        # certain from the flags: the forkserver imports torch for the workers while this process imports it
        # and reads the data. Under --devices auto nothing starts here: the plan starts it once it has chosen
        # (one started on a guess beside a run that then trained in this process cost that run 16%).
        prefork.warm_up(signal_for(env, cfg), cfg.model)
    from .. import session
    from ..components.inputs import load_for

    if args.print_split:
        print(strategies.split_table(cfg, load_for(cfg)))
        return 0
    if args.mesh and args.devices is None and not env.in_group:  # the mesh set the workers: what the cores cannot
        from ..runtime.devices import check_workers  # take is said of it, not of a --devices never given

        check_workers(cfg.accelerator, int(cfg.devices), cfg.oversubscribe, f"--mesh {args.mesh} ({cfg.devices} "
                      "workers)", "give a mesh of {cores} workers or fewer")
    if "custom" in (cfg.model, cfg.dataset, cfg.optimizer):  # a resumed run of the user's own parts or tensors
        raise UserError(f"{cfg.resume or 'this run'} trains a network, optimizer or tensors of your own: carry it on "
                        "in Python, paratrain.fit(model=make_net, data=..., optimizer=..., "
                        "config=TrainConfig(resume=...))")
    if env.is_main:
        check_writable(cfg.out)  # rank 0 writes the run directory (other nodes may not see it)
    session.run(cfg, lambda: load_for(cfg), env=env)  # which prints the last line
    return 0
