"""`paratrain generate`: text sampled from a run's language model (inference/generate.py)."""

from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a run's language model (--model gpt, or yours by path)")
    p.add_argument("run_dir", metavar="RUN", help="a run directory, or one of its checkpoints")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, default=40, help="tokens to add (default: 40)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divide the scores by this before drawing (default: 1; 0: always the likeliest token)")
    p.add_argument("--top-k", type=int, default=None, help="draw from the k likeliest tokens only")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    p.add_argument("--tokenizer", help="a run trained on tensors of token ids: the tokenizer they came from "
                                       "(a run on text uses its own)")
    p.add_argument("--ema", action="store_true", help="the averaged weights (runs with --ema)")
    p.add_argument("--model", metavar="PATH:FACTORY", help="a run of a network of yours given to paratrain.fit: "
                                                           "its factory, as --model takes one (hf.py:make_gpt2)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..core.errors import UserError
    from ..core.import_path import is_import_path
    from ..inference.generate import load_generator

    if args.tokens < 0:
        raise UserError(f"--tokens must be 0 or more, not {args.tokens}")
    if args.model is not None and not is_import_path(args.model):
        raise UserError(f"--model {args.model}: give the factory of your network as path/to/file.py:factory or "
                        "package.module:factory")
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), 4))  # one small model, one sequence: more threads wait
    try:
        factory = None
        if args.model is not None:
            from ..models.imported import resolve

            factory = resolve(args.model)
        generator = load_generator(args.run_dir, factory, ema=args.ema, tokenizer=args.tokenizer)
    except UserError as e:
        if "factory" in str(e) and args.model is None:  # a network of the user's given to paratrain.fit
            raise UserError(f"{e}; from the command line: paratrain generate {args.run_dir} --model "
                            "path/to/file.py:make_net ...") from None
        raise
    print(generator.generate(args.prompt, args.tokens, args.temperature, args.top_k, args.seed), flush=True)
    return 0
