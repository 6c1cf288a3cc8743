"""`paratrain eval`: test accuracy and loss of a checkpoint (api.evaluate)."""

from __future__ import annotations

import argparse

from .. import config as C


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="test accuracy and loss of a checkpoint")
    p.add_argument("run_dir", metavar="RUN", nargs="?",
                   help="a run directory, one of its step checkpoints, or a .pt file (or --checkpoint)")
    p.add_argument("--checkpoint", help="a run directory, one of its step checkpoints, or a .pt file")
    p.add_argument("--dataset", choices=C.DATASETS[:-1], help="default: the checkpoint's dataset")
    p.add_argument("--data-dir", help="the dataset's folder (default: ./data/<dataset>; never the checkpoint's)")
    p.add_argument("--no-download", dest="download", action="store_false", default=None,
                   help="never download: a missing dataset is an error")
    p.add_argument("--model", metavar="FILE.py:FACTORY",
                   help="a run of a network of your own: the file (or module) and function that build it")
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import api
    from ..core.errors import UserError

    if (args.run_dir is None) == (args.checkpoint is None):
        raise UserError("name one checkpoint: paratrain eval RUN_DIR (or --checkpoint RUN_DIR_OR_PT)")
    from ..core.errors import NeedsFactory, NeedsNoFactory
    from ..core.import_path import is_import_path

    factory = None
    if args.model is not None:
        if not is_import_path(args.model):
            raise UserError(f"--model {args.model}: name the file and function that build your network, "
                            "--model FILE.py:FACTORY (a built-in model is read from the checkpoint)")
        from ..models.imported import resolve

        factory = resolve(args.model)
    try:
        result = api.evaluate(args.run_dir or args.checkpoint, dataset=args.dataset, data_dir=args.data_dir,
                              download=args.download, accelerator=args.accelerator, model=factory)
    except NeedsFactory as e:  # the command line's terms, not Python's
        raise UserError(f"{e.run} holds a network of your own (its parts.yaml names it): pass --model FILE.py:FACTORY, "
                        "the file and function that build it") from None
    except NeedsNoFactory as e:
        raise UserError(f"{e.run} holds a {e.model} (a built-in network, built from its checkpoint): drop --model "
                        f"{args.model}") from None

    acc = result["test_accuracy"]  # None: a task without classes
    metrics = "".join(f"  {k} {v:.4f}" for k, v in result.items() if k.startswith("test_") and
                      k not in ("test_accuracy", "test_loss", "test_examples") and v is not None)
    examples = f"test examples: {result['rows']}" if result.get("kind") == "tensors" else "test images"
    print(("" if acc is None else f"test_accuracy {acc:.4f}  ") + f"test_loss {result['test_loss']:.4f}{metrics}  "
          f"({result['test_examples']} {result['dataset']} {examples}, {result['model']}"
          f"{' EMA' if result['ema'] else ''} weights, step {result['step']})")
    return 0
