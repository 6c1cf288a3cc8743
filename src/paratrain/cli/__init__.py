"""The command line: the only place that parses flags, a client of the library (api.py and the modules it
calls). One module per command, each with `add(subparsers)` and `run(args) -> exit code`."""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import signal
import sys
from typing import NoReturn

from ..config import REQUEUE_SIGNALS
from ..core.errors import UserError, one_line
from ..runtime.env import detect
from ..runtime.interrupt import Stopped, hold, signal_number
from ..runtime.proc import end_process
from . import bench, devices, doctor, evaluate, export, generate, log, plan, recipes, report, search, submit, train
from .parser import Parser
from .train import resolve_config

# in the order --help lists them
COMMANDS = (devices, doctor, recipes, train, submit, bench, search, report, log, plan, evaluate, export, generate)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="paratrain", description="Train a PyTorch network (images, tables, text, a language model to "
                    "fine-tune) on every device you have, and see what the parallelism bought: data, tensor and "
                    "pipeline parallelism, searches over a pool of devices, benches.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = None
    try:
        env = args.env = detect()  # once per process, handed to the command; a bad Slurm variable is one line
        # the command, not a caller's main([...]): `kill -USR1 PID` prints where every thread is (a stuck run); in
        # a Slurm job USR1 is the scheduler's warning before the end (--requeue-signal), never a dump
        if hasattr(signal, "SIGUSR1") and argv is None and env.slurm is None:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        if env.slurm is not None and argv is None:  # its warning may come while the run starts: kept for it
            hold(tuple(signal_number(name) for name in REQUEUE_SIGNALS))
        code = args.run(args)
    except UserError as e:
        print(f"paratrain: {'' if isinstance(e, Stopped) else 'error: '}{one_line(e)}", file=sys.stderr)
        code = e.code
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        code = 130
    if args.command == "train" and env is not None and env.in_group:
        end_process(code)  # a worker of torchrun's group: leave without finalization (see proc.end_process)
    return code


def entry() -> NoReturn:
    """The `paratrain` command: main, then leave without tearing the interpreter down module by module (with
    torch and its compiler loaded that took 0.5 s after every command here). The exit handlers still run
    (multiprocessing's, the run's); every file paratrain writes is closed by then."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["build_parser", "entry", "main", "resolve_config"]
