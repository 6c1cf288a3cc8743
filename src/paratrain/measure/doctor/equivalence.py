"""The 1-versus-N check: 10 steps of a small network on synthetic images on one device and on N, with each
strategy the devices allow, and of a GRU over token ids (a task that is not images: integer inputs, an
embedding) under ddp, compared weight by weight (`accelerate test` compares one configuration trained on one
process and distributed; this does it for each of paratrain's strategies)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ... import config
from ...checkpoint import files as checkpoint
from ...core.errors import UserError
from ...data import load_dataset
from ...parallel import launch, runplan
from ...parallel.strategies import checked
from ...training.worker import work

STEPS = 10
# SGD with momentum far from divergence: N workers differ from one only by the order of float sums (measured
# 1e-8 on CPU workers); a broken all-reduce or a wrong batch split moves the weights by 1e-3 or more.
SETTINGS = dict(batch_size=64, steps=STEPS, optimizer="sgd", lr=0.01, momentum=0.9, seed=0, quiet=True,
                tensorboard=False, checkpoint_every=STEPS)
TASKS = {"images": dict(model="mlp", dataset="synthetic", width=64, depth=2),
         "token ids": dict(model="gru", dataset="tokens", width=32, depth=1)}
BOUND = 1e-4


def runs_for(n: int) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(task, strategy, its devices, its own options): on images ddp on N workers, the tower (one process)
    and a pipeline of 2 stages; on token ids ddp; where the devices allow."""
    if n < 2:
        return []
    return [("images", "ddp", n, {}), ("images", "tower", n, {}),
            ("images", "pipeline", 2, {"stages": 2, "microbatches": 2}), ("token ids", "ddp", n, {})]


def _train(folder: Path, accelerator: str, task: str, strategy: str, devices: int, threads: int, data: Any,
           options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    cfg = config.validate(config.TrainConfig(**SETTINGS, **TASKS[task], **(options or {}), strategy=strategy,
                                             accelerator=accelerator, devices=str(devices),
                                             threads_per_worker=threads, out=str(folder)))
    folder.mkdir(parents=True, exist_ok=True)
    launch.run(runplan.make(checked(cfg), lambda: data), work)
    return checkpoint.load(folder)["model"]  # the newest checkpoint, a file or a sharded folder


def check(accelerator: str, n: int, threads: int) -> list[dict[str, Any]]:
    """One result per task and strategy: the largest weight difference between 1 device and N (or the
    error)."""
    data = {task: load_dataset(TASKS[task]["dataset"]) for task in TASKS}
    results, one = [], {}
    with tempfile.TemporaryDirectory(prefix="paratrain-doctor-") as tmp:
        for task, strategy, used, options in runs_for(n):
            result: dict[str, Any] = {"task": task, "strategy": strategy, "devices": used, "steps": STEPS}
            try:
                if task not in one:
                    try:
                        one[task] = _train(Path(tmp) / task / "one", accelerator, task, "ddp", 1, threads, data[task])
                    except (UserError, RuntimeError) as e:  # no reference: the task's comparisons fail with it
                        one[task] = RuntimeError(f"the one-device run failed: {' '.join(str(e).split())[:300]}")
                if isinstance(one[task], Exception):
                    raise one[task]
                # the tower is planned as N workers, then runs as one process with their threads
                many = _train(Path(tmp) / task / strategy, accelerator, task, strategy, used,
                              max(1, threads // used), data[task], options)
                result["max_abs_diff"] = max(float((one[task][k] - many[k]).abs().max()) for k in one[task])
                result["ok"] = result["max_abs_diff"] <= BOUND
            except (UserError, RuntimeError) as e:  # a strategy that failed here is the check's finding
                result["error"], result["ok"] = " ".join(str(e).split())[:300], False
            results.append(result)
    return results
