"""`paratrain log`: a finished (or stopped) run's records sent to experiment trackers afterwards: the run that
trained while its tracker was down, or before the team had one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("log", help="send a run's options, figures and summary to MLflow, W&B or a CSV table")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--logger", required=True, help="one or more of csv, mlflow, wandb, comma-separated")
    p.add_argument("--mlflow-uri", help="mlflow: the tracking server or store (default: the run's --mlflow-uri, "
                   "else $MLFLOW_TRACKING_URI)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.run_folder import held
    from ..components import trackers
    from ..config import TrainConfig
    from ..config.checks import validate
    from ..core.errors import UserError

    validate(TrainConfig(logger=args.logger, mlflow_uri=args.mlflow_uri))  # the names, a password in the URI
    names = trackers.named(args.logger)
    if "tensorboard" in {n.strip() for n in args.logger.split(",")}:
        raise UserError("--logger tensorboard: a run writes its TensorBoard files as it trains (RUN_DIR/tb); "
                        "paratrain log sends to csv, mlflow and wandb")
    for run_dir in map(Path, args.runs):
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{run_dir}: no config.yaml there; pass the directory of a paratrain run")
        with held(run_dir):  # a run still training there owns its trackers.json
            trackers.send(run_dir, names, lambda line: print(line, file=sys.stderr), uri=args.mlflow_uri)
    return 0
