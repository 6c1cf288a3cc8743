"""The plan of a run: everything decided before a worker starts, built the same way by every caller (the
command line and `paratrain.fit` through `api.train`, a search trial, a test) and handed to `launch.run`.

    make(cfg, load_data)  the strategy's defaults, the processes and their devices, the batch split, the
                          checkpoint carried on from, the data, the strategy's layout (a pipeline's cuts, a
                          tower's replica devices), and the checks of a user's own network and of the weights

Workers read the strategy's decisions from the plan's `layout`; the configuration in it is the resolved one
that config.yaml records (a pipeline's cuts in `split`, say), never how a worker learns a decision.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import config as C
from .data import Splits
from .devices import Plan
from .errors import UserError
from .import_path import is_import_path
from .parts import Parts


@dataclass(frozen=True)
class RunPlan:
    cfg: C.TrainConfig  # resolved: what config.yaml records
    hardware: Plan  # the processes: accelerator, how many, threads each, backend
    devices: tuple[str, ...]  # each worker's device on this machine, by local rank ("cpu", "cuda:1")
    data: Splits
    resume: dict[str, Any] | None = None  # the checkpoint this run carries on from
    parts: Parts | None = None  # the user's own network, optimizer and loss (None: the configuration's)
    layout: dict[str, Any] = field(default_factory=dict)  # the strategy's own decisions (its `plan`/`prepare`)
    # after each epoch's validation, rank 0 calls report(epoch, val_accuracy); True stops the run (a search
    # trial's pruner)
    report: Callable[[int, float], bool] | None = None
    clock: dict[str, float] = field(default_factory=dict)  # when the run reached each start-up mark (clock.py)

    def carried_on(self, resume: dict[str, Any] | None, run: str) -> RunPlan:
        """This plan, carrying on from `resume` (the newest checkpoint of the run in `run`)."""
        if resume is None:
            return self
        return dataclasses.replace(self, resume=resume, cfg=self.cfg.replace(resume=run))


def device_map(hardware: Plan, first: int = 0) -> tuple[str, ...]:
    """Each worker's device: a GPU each from `first` on, or the CPU."""
    if hardware.accelerator == "gpu":
        return tuple(f"cuda:{first + i}" for i in range(hardware.workers))
    return ("cpu",) * hardware.workers


def make(cfg: C.TrainConfig, load_data: Callable[[], Splits], parts: Parts | None = None, *,
         hardware: Plan | None = None, devices: tuple[str, ...] | None = None,
         resume: dict[str, Any] | None = None, report: Callable[[int, float], bool] | None = None) -> RunPlan:
    """Plan the run, checking what can be checked before any process starts (UserError otherwise).
    `hardware`/`devices`: processes and devices chosen by the caller (a search trial's share of the pool)
    instead of from cfg; `resume`: a checkpoint already loaded instead of cfg.resume's last.pt; `report`: see
    RunPlan.report."""
    from . import launch, strategies
    from .train import run_length

    strategy = strategies.get(cfg.strategy)
    cfg = strategy.defaults(cfg)
    torchrun = launch.under_torchrun()
    if hardware is None:
        hardware = _hardware(cfg, torchrun)
    if devices is None:  # under torchrun: this node's workers, by local rank
        devices = device_map(dataclasses.replace(hardware, workers=launch.local_workers()) if torchrun else hardware)
    cfg, planned, layout = strategy.plan(cfg, hardware, torchrun)
    if "replicas" in layout:  # devices driven from one process (the tower), named by their place in the map
        layout = {**layout, "replicas": [devices[i] for i in layout["replicas"]]}
    devices = tuple(d if planned.accelerator == "gpu" else "cpu" for d in devices[:planned.workers])
    if resume is None and cfg.resume:
        resume = _resume(cfg)
    if is_import_path(cfg.model):  # a typo in the path fails before the data is decoded, not after
        from .models.imported import resolve

        resolve(cfg.model)
    if cfg.compile:
        _check_compiler(planned.accelerator)
    data = load_data()
    run_length(cfg, len(data.train[1]))  # the batch against the data, before any process starts
    if (cfg.early_stopping is not None or report is not None) and not len(data.val[1]):
        raise UserError("early stopping and a search's pruner watch the validation set, and this data has none: "
                        "give it validation images")
    cfg, more = strategy.prepare(cfg, data, parts)
    cfg, parts = _check_own(cfg, data, parts, resume)
    return RunPlan(cfg, planned, devices, data, resume, parts, {**layout, **more}, report)


def _check_compiler(accelerator: str) -> None:
    """torch.compile's CPU code generator (inductor) builds C++: without a compiler every worker would fail
    at its first step, in a long traceback."""
    import shutil
    import sysconfig

    if accelerator != "cpu":
        return
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c):
        raise UserError("--compile on the CPU needs a C++ compiler, and none was found (g++, clang++, c++ or $CXX): "
                        "install one (apt install g++; xcode-select --install) or leave out --compile")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        raise UserError(f"--compile on the CPU builds against Python's headers, and {headers} is missing: install "
                        "them (apt install python3-dev) or leave out --compile")


def _hardware(cfg: C.TrainConfig, torchrun: bool) -> Plan:
    from . import devices, launch

    if torchrun:
        return launch.torchrun_plan(cfg.accelerator, cfg.threads_per_worker)
    return devices.resolve(cfg.accelerator, cfg.devices, cfg.threads_per_worker, cfg.oversubscribe)


def _resume(cfg: C.TrainConfig) -> dict[str, Any]:
    """The checkpoint of the run in cfg.resume, checked against this configuration."""
    from . import checkpoint

    resume = checkpoint.load(Path(cfg.resume))  # the newest of its checkpoints that loads
    if why := checkpoint.model_mismatch(resume, cfg.model, cfg.resume):
        saved = resume["config"].get("model")
        how = ("in Python: paratrain.fit(model=make_net, config=TrainConfig(resume=...))" if saved == "custom"
               else f"without a factory of yours (paratrain.fit(model=None, ...)), it trains the registry's {saved}"
               if cfg.model == "custom" else f"with --model {saved}")
        raise UserError(f"{why}; resume {how}")
    from .data.folder import SPLIT_SCHEME

    held_out_here = cfg.dataset == "imagefolder" or (Path(cfg.resume) / "data-cache").is_dir()  # a Dataset's
    if held_out_here and resume.get("data", {}).get("split") not in (SPLIT_SCHEME, "index-hash"):
        raise UserError(f"the run in {cfg.resume} was made before paratrain chose held-out images by a hash of "
                        "their names; carried on, it would train on its old test images: start a new run")
    if resume["config"].get("dataset") not in (cfg.dataset, None):
        raise UserError(f"the run in {cfg.resume} trained on {resume['config']['dataset']}; carrying it on with "
                        f"{cfg.dataset} would mix two datasets in one run: drop --dataset, or start a new run")
    return resume


def _check_own(cfg: C.TrainConfig, data: Splits, parts: Parts | None,
               resume: dict[str, Any] | None) -> tuple[C.TrainConfig, Parts | None]:
    """A user's own network, optimizer or loss tried once here (a factory that raises is one line, not a
    traceback in every worker), and recorded; a checkpoint's weights tried against the network."""
    from . import checkpoint
    from .own import check_and_describe, settings_that_ran

    net = None
    own = parts is not None and bool(parts.model or parts.optimizer or parts.loss)
    if own or is_import_path(cfg.model):
        record, net = check_and_describe(parts or Parts(), cfg, data)
        if own:
            parts = dataclasses.replace(parts, record=record)
            cfg = cfg.replace(**settings_that_ran(record.get("optimizer", {})))
    if resume is not None:  # weights that do not fit fail here in one line, not in every worker
        from .build import make_model

        checkpoint.load_weights(net if net is not None else make_model(cfg, data, parts), resume, cfg.resume,
                                cfg.to_dict())
    return cfg, parts
