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
                   "else $MLFLOW_TRACKING_URI, else the store the run logged to, else MLflow's default here)")
    p.add_argument("--experiment", help="the MLflow experiment or W&B project of a new tracker run (default: the "
                   "run's --experiment, else the name of its folder's parent)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.run_folder import held
    from ..config import TrainConfig
    from ..config.checks import validate
    from ..core.errors import UserError
    from ..core.run_paths import RunPaths
    from ..tracking import trackers

    validate(TrainConfig(logger=args.logger, mlflow_uri=args.mlflow_uri))  # the names, a password in the URI
    names = trackers.named(args.logger)
    if "tensorboard" in {n.strip() for n in args.logger.split(",")}:
        raise UserError("--logger tensorboard: a run writes its TensorBoard files as it trains (RUN_DIR/tb); "
                        "paratrain log sends to csv, mlflow and wandb")
    failed = []
    for run_dir in map(Path, args.runs):
        if not RunPaths(run_dir).config.is_file():
            raise UserError(f"{run_dir}: no config.yaml there; pass the directory of a paratrain run")
        with held(run_dir):  # a run still training there owns its trackers.json
            kept = trackers.kept(run_dir)
            done = [n for n in names if n != "csv" and "ended" in kept.get(n, {}) and "sent" not in kept[n]]
            for name in done:  # sent again, its figures would be there twice
                print(f"paratrain: {run_dir} is already in {name} (its run there ended {kept[name]['ended']}); "
                      "nothing to send", file=sys.stderr)
            todo = [n for n in names if n not in done]
            failures = trackers.send(run_dir, todo, lambda line: print(line, file=sys.stderr), warn=lambda _: None,
                                     uri=args.mlflow_uri, experiment=args.experiment) if todo else {}
        failed += [f"{run_dir}: --logger {name} failed ({why})" for name, why in failures.items()]
    if failed:  # nothing is lost: trackers.json says where the next try takes up
        raise UserError(f"{'; '.join(failed)}; nothing of the run is lost: run this command again once the "
                        "tracker answers (or with the --mlflow-uri of the store the run logged to)", code=1)
    return 0
