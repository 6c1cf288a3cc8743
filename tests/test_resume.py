"""Which checkpoint a run carries on from (src/paratrain/checkpoint/resume.py), alone: the newest one that
loads, checked against the run that asks (its model, its dataset, the steps asked for), in the words the
launcher's own checks use; and a fresh run's folder holds none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_earlier_release_step, save_step

from paratrain import config
from paratrain.checkpoint import dcp, resume
from paratrain.checkpoint.manager import RunCheckpoints
from paratrain.core.errors import UserError


def _cfg(out: Path, **kw: object) -> config.TrainConfig:
    values = {"model": "mlp", "dataset": "digits", "out": str(out), "steps": 20, **kw}
    return config.validate(config.TrainConfig(**values))


def _state(step: int, cfg: config.TrainConfig) -> dict:
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
            "step": step, "epoch": 0, "config": cfg.to_dict()}


def _save(out: Path, step: int, cfg: config.TrainConfig) -> None:
    save_step(_state(step, cfg), out / "checkpoints", step, keep=3)


def test_a_fresh_folder_carries_nothing_on(tmp_path: Path) -> None:
    assert resume.read(_cfg(tmp_path), RunCheckpoints(tmp_path), 20) == (None, None)


def test_the_newest_checkpoint_that_loads_is_carried_on(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _save(tmp_path, 5, cfg)
    _save(tmp_path, 10, cfg)
    (tmp_path / "checkpoints" / "step-00000010" / dcp.META).write_bytes(b"damaged")
    state, problem = resume.read(cfg, RunCheckpoints(tmp_path), 20)
    # the tensors of a step folder are left to each worker's strategy to read, its own part
    assert problem is None and state["step"] == 5 and state["sharded"].endswith("step-00000005")


def test_an_earlier_releases_whole_model_file_is_carried_on(tmp_path: Path) -> None:
    """Before every layout wrote step folders, ddp wrote step-N.pt files and last.pt: still read, whole."""
    cfg = _cfg(tmp_path)
    save_earlier_release_step(_state(5, cfg), tmp_path / "checkpoints", 5)
    state, problem = resume.read(cfg, RunCheckpoints(tmp_path), 20)
    assert problem is None and state["step"] == 5 and state["model"]["w"][0] == 5 and "sharded" not in state


@pytest.mark.parametrize(("asked", "why"), [
    (dict(model="lenet5"), r"is of model 'mlp', not 'lenet5'; pass another --out"),
    (dict(dataset="synthetic"), r"trained on digits; carrying it on with synthetic would mix two datasets"),
    (dict(steps=4), r"has done 10 steps, more than the 4 asked for"),
])
def test_a_checkpoint_of_another_run_is_refused_with_its_reason(tmp_path: Path, asked: dict, why: str) -> None:
    _save(tmp_path, 10, _cfg(tmp_path))
    state, problem = resume.read(_cfg(tmp_path, **asked), RunCheckpoints(tmp_path), asked.get("steps", 20))
    assert state is None and problem is not None
    with pytest.raises(UserError, match=why):
        raise UserError(problem)


def test_a_resumed_run_is_told_how_to_carry_its_model_on() -> None:
    cfg = config.TrainConfig(model="lenet5", resume="RUN", out="RUN")
    assert resume.model_mismatch("mlp", cfg).endswith("resume with --model mlp")
    assert "paratrain.fit(model=make_net" in resume.model_mismatch("custom", cfg)
    assert resume.model_mismatch("lenet5", cfg) is None and resume.dataset_mismatch(None, cfg) is None
