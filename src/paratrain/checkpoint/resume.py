"""The one point a run carries on from: the newest checkpoint of the run folder that loads, agreed on by
the group, and checked against the run that asks for it.

Every start of a worker looks here, whatever started it: a fresh run (whose folder was cleared: it finds
nothing), `--resume`, a restart after a dead worker (--max-restarts), torchrun's starts and restarts. Each
worker reads its own disk once; the group agrees on the newest step, and only a worker that lacks it (on
another node's disk) is sent it (checkpoint/files.py: agree). The checks that need the checkpoint run here, in the
words the launcher's checks of config.yaml use (session.py): its model, its dataset, how its held-out
images were chosen, and whether the run already went past the steps asked for.
"""

from __future__ import annotations

from typing import Any

from ..config import TrainConfig
from ..config.length import check_not_past
from ..core.errors import UserError
from ..core.run_paths import RunPaths
from ..data.folder import SPLIT_SCHEME
from ..runtime.dist import DistContext
from . import files as checkpoint
from .manager import RunCheckpoints


def resume_point(ctx: DistContext, cfg: TrainConfig, checkpoints: RunCheckpoints, total_steps: int,
                 restarts: int) -> tuple[dict[str, Any] | None, int]:
    """The checkpoint this worker carries on from (None: a fresh start), and the group's restart count
    (collective where the group has several workers; every worker calls it). `checkpoints`: the worker's owner of
    the run's checkpoints; `total_steps`: the plan's length."""
    found, problem = read(cfg, checkpoints, total_steps)
    return checkpoint.agree(ctx, found, problem, restarts)


def read(cfg: TrainConfig, checkpoints: RunCheckpoints, total_steps: int) -> tuple[dict[str, Any] | None, str | None]:
    """This worker's newest loadable checkpoint of the run in cfg.out (`checkpoints`), or why it cannot carry the
    run on."""
    try:
        # a step folder's tensors are read by the strategy, each rank its own part (Strategy.load)
        state = checkpoints.newest_loadable()
    except UserError as e:
        return None, str(e)
    if state is None:
        return None, None
    try:
        check(state, cfg, total_steps)
    except UserError as e:
        return None, str(e)
    return state, None


def check(state: dict[str, Any], cfg: TrainConfig, total_steps: int) -> None:
    """Whether the checkpoint `state` of the run in cfg.out can carry on the run `cfg` asks for."""
    run = cfg.out
    checkpoint.check_resumable(state, run)
    if why := model_mismatch(state["config"].get("model"), cfg):
        raise UserError(why)
    if why := dataset_mismatch(state["config"].get("dataset"), cfg):
        raise UserError(why)
    held_out_here = cfg.dataset == "imagefolder" or RunPaths(run).data_cache.is_dir()  # a Dataset's
    if held_out_here and state.get("data", {}).get("split") not in (SPLIT_SCHEME, "index-hash"):
        raise UserError(f"the run in {run} was made before paratrain chose held-out images by a hash of "
                        "their names; carried on, it would train on its old test images: start a new run")
    check_not_past(int(state["step"]), total_steps, run)


def model_mismatch(saved: str | None, cfg: TrainConfig) -> str | None:
    """Why a run of model `saved` cannot be carried on as `cfg` asks (None: it can)."""
    if saved == cfg.model:
        return None
    why = f"the checkpoint in {cfg.resume or cfg.out} is of model '{saved}', not '{cfg.model}'"
    if not cfg.resume:  # a start that found a checkpoint in --out (torchrun's): not the run it meant to start
        return f"{why}; pass another --out for a new run"
    how = ("in Python: paratrain.fit(model=make_net, config=TrainConfig(resume=...))" if saved == "custom"
           else f"without a factory of yours (paratrain.fit(model=None, ...)), it trains the registry's {saved}"
           if cfg.model == "custom" else f"with --model {saved}")
    return f"{why}; resume {how}"


def shape_mismatch(saved: dict[str, Any], cfg: TrainConfig) -> str | None:
    """Why a run whose configuration was `saved` cannot be carried on with the model options `cfg` changed (the
    options that shape a registry model: its weights would not fit), in the words the workers' load uses."""
    if saved.get("model") != cfg.model or cfg.model == "custom":
        return None
    return checkpoint.options_changed(saved, cfg.to_dict(), cfg.resume)


def dataset_mismatch(saved: str | None, cfg: TrainConfig) -> str | None:
    if saved in (cfg.dataset, None):
        return None
    return (f"the run in {cfg.resume or cfg.out} trained on {saved}; carrying it on with {cfg.dataset} would mix two "
            "datasets in one run: drop --dataset, or start a new run")
