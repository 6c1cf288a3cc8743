"""The plan of a run: everything decided before a worker starts, built the same way by every caller (the
command line and `paratrain.fit` through `api.train`, a search trial, a test) and handed to `launch.run`.

    make(cfg, load_data)  of a checked configuration (strategies.checked, by the caller): the strategy's
                          defaults, the processes and their devices, the batch split, the data, the checks of a
                          user's own network, the strategy's layout (a pipeline's cuts, a tower's replica devices)

The checkpoint a run carries on from is not in the plan: every worker finds it in the run folder (resume.py),
which a fresh run has cleared.

Workers read the strategy's decisions from the plan's `layout`; the configuration in it is the resolved one
that config.yaml records (a pipeline's cuts in `split`, say), never how a worker learns a decision.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import config as C
from ..checkpoint.manager import Found
from ..components.build import check_tensor_model, pretrained_model
from ..components.parts import Parts
from ..components.parts_check import check_and_describe, check_task, settings_that_ran
from ..config.length import Length, run_length
from ..core.errors import UserError
from ..core.import_path import is_import_path, is_own_network
from ..data import Splits
from ..data.source import read_on_demand
from ..data.tensors import as_numbers, standardized
from ..models.imported import resolve
from ..optimization.metrics import for_run
from ..runtime import prefork
from ..runtime.devices import Hardware, device_map, for_group, group_devices, precision_on
from ..runtime.devices import resolve as resolve_devices
from ..runtime.env import LOCAL, Environment
from . import requeue, strategies
from .layout import Layout

PACKED = ", as --pack makes them"  # (a pipeline's refusal of named columns says where they came from)


@dataclass(frozen=True)
class RunPlan:
    cfg: C.TrainConfig  # resolved: what config.yaml records
    hardware: Hardware  # the processes: accelerator, how many, threads each, backend
    devices: tuple[str, ...]  # each worker's device on this machine, by local rank ("cpu", "cuda:1")
    data: Splits
    length: Length  # the run's updates and epochs, computed once here (config/length.py)
    parts: Parts | None = None  # the user's own network, optimizer and loss (None: the configuration's)
    layout: Layout = Layout()  # how the run is spread: its mesh, cuts, replicas (its strategy's arrange/prepare)
    # after each epoch's validation, rank 0 calls report(epoch, {"val_accuracy": .., "val_loss": .., "val_<metric>":
    # ..}); True stops the run (a search trial's pruner)
    report: Callable[[int, dict[str, float]], bool] | None = None
    clock: dict[str, float] = field(default_factory=dict)  # when the run reached each start-up mark (clock.py)
    env: Environment = LOCAL  # who started the processes (a local launch, or torchrun's group)
    # Slurm's warning before a job's end, where the run stops to be requeued (requeue.signal_for); None elsewhere
    requeue_signal: int | None = None
    # what the launcher found in the run folder's checkpoints/, listed once (checkpoint/manager.py); each worker
    # still reads the checkpoint it carries on from itself
    checkpoints: Found = Found()
    # the launcher's session writes summary.json once the workers have left (False: rank 0's Trainer writes it,
    # where no session waits for the workers: torchrun's and srun's ranks, a test's launch)
    launcher_writes_summary: bool = False


def network_file(cfg: C.TrainConfig, parts: Parts | None) -> str:
    """Where the run's network is built, for the forkserver to read which libraries it imports (prefork.preload):
    --model's import path, or the file of what paratrain.fit was given to build it (a script's function that
    builds a GPT-2 of transformers': each worker imports the script again, and with it transformers)."""
    import inspect

    if parts is None or parts.model is None:
        return cfg.model
    try:
        return f"{inspect.getsourcefile(parts.model)}:network"
    except TypeError:  # a callable of no file of its own
        return cfg.model


def make(cfg: C.TrainConfig, load_data: Callable[[], Splits], parts: Parts | None = None, *,
         hardware: Hardware | None = None, devices: tuple[str, ...] | None = None,
         report: Callable[[int, dict[str, float]], bool] | None = None, env: Environment = LOCAL) -> RunPlan:
    """Plan the run, checking what can be checked before any process starts (UserError otherwise). `cfg`: checked
    (strategies.checked, which its caller ran once: the command line, paratrain.fit, a search's trial).
    `hardware`/`devices`: processes and devices chosen by the caller (a search trial's share of the pool)
    instead of from cfg; `report`: see RunPlan.report; `env`: the process environment (env.detect)."""
    strategy = strategies.get(cfg.strategy)
    cfg = strategy.defaults(cfg)
    if hardware is None:
        hardware = _hardware(cfg, env)
    if devices is None:  # under a launcher's group: this node's workers, by local rank
        devices = group_devices(env, hardware) if env.in_group else device_map(hardware)
    cfg, arranged, layout = strategy.arrange(cfg, hardware, env)
    layout = _placed(layout, devices)
    devices = tuple(d if arranged.accelerator == "gpu" else "cpu" for d in devices[:arranged.workers])
    if is_import_path(cfg.model):  # a typo in the path fails before the data is decoded, not after
        resolve(cfg.model)
    if cfg.compile:
        _check_compiler(arranged.accelerator)
    precision, note = precision_on(cfg.precision, arranged)
    if note and env.is_main:
        print(f"paratrain: note: {note}", file=sys.stderr, flush=True)
    cfg = cfg.replace(precision=precision)  # what config.yaml records: what ran
    signum = requeue.signal_for(env, cfg)
    if arranged.workers > 1 and not env.in_group:  # known now: workers will be forked, so their forkserver
        prefork.warm_up(signum, network_file(cfg, parts))  # imports torch while this process reads the data
    data = load_data()
    length = run_length(cfg, len(data.train[1]))  # the batch against the data, before any process starts
    if cfg.host_data and env.is_main:
        _note_host_data(arranged.accelerator, data)
    if data.images:
        _check_for_images(cfg)
    if (cfg.early_stopping is not None or report is not None) and not len(data.val[1]):
        raise UserError("early stopping and a search's pruner watch the validation set, and this data has none: "
                        "give it validation images")
    if not data.images:
        _check_for_tensors(cfg)
        data = standardized(data) if cfg.standardize else data
        if data.classification and cfg.loss not in ("auto", "cross-entropy") and (parts is None or parts.loss is None):
            if data.classes:  # names (a CSV's text column): their numbers would be alphabetical, meaningless
                raise UserError(f"--loss {cfg.loss} compares numbers, and these targets are classes by name "
                                f"({', '.join(data.classes[:3])}{', ...' if len(data.classes) > 3 else ''}): leave "
                                "--loss out (cross-entropy)")
            data = as_numbers(data)  # the loss compares numbers: whole-number targets are a regression's
            if env.is_main and not cfg.quiet:
                print(f"paratrain: note: --loss {cfg.loss} takes the targets as numbers (a regression), not as the "
                      "class indices they look like", file=sys.stderr, flush=True)
        check_task(cfg, data, parts.loss if parts is not None else None)
        if hasattr(data.train[0], "columns") and (layout.mesh.pp > 1 or layout.replicas):
            raise UserError(f"--strategy {cfg.strategy} cuts or copies an nn.Sequential and hands it one tensor; these "
                            f"inputs are named columns (a dict{PACKED * cfg.pack}): use ddp, fsdp or tp")
        if (parts is None or parts.model is None) and not is_own_network(cfg.model):  # the registry's network
            check_tensor_model(cfg, data, every_id=True)
    for_run(cfg.metric, parts.metrics if parts is not None else None, data)  # what a worker builds
    # the user's code first: a factory that raises is one line naming its line, whatever the strategy builds next
    cfg, parts = _check_own(cfg, data, parts, env.is_main)
    cfg, layout = strategy.prepare(cfg, data, parts, layout)
    return RunPlan(cfg, arranged, devices, data, length, parts, layout, report, env=env,
                   requeue_signal=signum)


def _check_for_images(cfg: C.TrainConfig) -> None:
    if cfg.loss not in ("auto", "cross-entropy"):
        raise UserError(f"--loss {cfg.loss} compares numbers, and images are classified: leave --loss out (or "
                        "give paratrain.fit the images as tensors with float targets for a regression)")
    if cfg.standardize:
        raise UserError("--standardize scales the features of tensors; images are normalised per channel already: "
                        "leave it out")


def _check_for_tensors(cfg: C.TrainConfig) -> None:
    """What only images take, refused for data that is not images (which goes to the network as it is)."""
    for on, flag in ((cfg.random_crop, "--random-crop"), (cfg.hflip, "--hflip"), (cfg.brightness, "--brightness"),
                     (cfg.contrast, "--contrast"), (cfg.test_flip, "--test-flip"), (cfg.image_size, "--image-size"),
                     (cfg.memory_format == "channels_last", "--memory-format channels_last")):
        if on:
            raise UserError(f"{flag} is for images; this data is tensors (inputs of any shape, given to the network as "
                            "they are): leave it out")


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


def _hardware(cfg: C.TrainConfig, env: Environment) -> Hardware:
    if env.in_group:
        return for_group(env, cfg.accelerator, cfg.threads_per_worker, cfg.devices)
    return resolve_devices(cfg.accelerator, cfg.devices, cfg.threads_per_worker, cfg.oversubscribe)


def _check_own(cfg: C.TrainConfig, data: Splits, parts: Parts | None,
               speaks: bool) -> tuple[C.TrainConfig, Parts | None]:
    """A user's own network, optimizer or loss tried once here (a factory that raises is one line, not a
    traceback in every worker), and recorded; the weights --init-from names checked against the model (built on
    the meta device)."""
    own = parts is not None and bool(parts.model or parts.optimizer or parts.loss)
    if own or is_own_network(cfg.model):
        record = check_and_describe(parts or Parts(), cfg, data, speaks)
        if own:
            parts = dataclasses.replace(parts, record=record)
            cfg = cfg.replace(**settings_that_ran(record.get("optimizer", {})))
    if cfg.init_from:
        pretrained_model(cfg, data, parts)
    return cfg, parts


def with_hardware(plan: RunPlan, hardware: Hardware) -> RunPlan:
    """The plan on other processes (what `--devices auto` measured and chose): the strategy arranges the batch
    over them again; the data, the user's code and what `prepare` decided stay."""
    cfg, arranged, layout = strategies.get(plan.cfg.strategy).arrange(plan.cfg, hardware, plan.env)
    return dataclasses.replace(plan, cfg=cfg, hardware=arranged, devices=device_map(arranged),
                               length=run_length(cfg, len(plan.data.train[1])),  # the batch split anew
                               layout=dataclasses.replace(_placed(layout, device_map(hardware)), cuts=plan.layout.cuts))


def _note_host_data(accelerator: str, data: Splits) -> None:
    """--host-data where the inputs are on the host anyway: said, so that nobody takes the flag for a change."""
    if accelerator == "cpu" or read_on_demand(data.train[0]):
        where = "a CPU's data is in host memory already" if accelerator == "cpu" else \
            "these inputs are read from their file a batch at a time already"
        print(f"paratrain: note: --host-data changes nothing here: {where}", file=sys.stderr, flush=True)


def _placed(layout: Layout, devices: tuple[str, ...]) -> Layout:
    """The layout with the tower's replicas named by their devices (its `arrange` gives their places in the
    run's device map)."""
    if not layout.replicas:
        return layout
    return dataclasses.replace(layout, replicas=tuple(devices[int(i)] for i in layout.replicas))
