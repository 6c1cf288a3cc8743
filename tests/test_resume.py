"""Which checkpoint a run carries on from (src/paratrain/checkpoint/resume.py), alone: the newest one that
loads, checked against the run that asks (its model, its dataset, the steps asked for), in the words the
launcher's own checks use; and a fresh run's folder holds none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain import config
from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint import resume
from paratrain.core.errors import UserError


def _cfg(out: Path, **kw: object) -> config.TrainConfig:
    values = {"model": "mlp", "dataset": "digits", "out": str(out), "steps": 20, **kw}
    return config.validate(config.TrainConfig(**values))


def _save(out: Path, step: int, cfg: config.TrainConfig) -> None:
    state = {"model": {"w": torch.full((2,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
             "step": step, "epoch": 0, "config": cfg.to_dict()}
    checkpoint.save_step(state, out / "checkpoints", step, keep=3)


def test_a_fresh_folder_carries_nothing_on(tmp_path: Path) -> None:
    assert resume.read(_cfg(tmp_path), 20) == (None, None)


def test_the_newest_checkpoint_that_loads_is_carried_on(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _save(tmp_path, 5, cfg)
    _save(tmp_path, 10, cfg)
    (tmp_path / "checkpoints" / "step-00000010.pt").write_bytes(b"damaged")  # last.pt is a link to it
    (tmp_path / "checkpoints" / "last.pt").unlink()
    state, problem = resume.read(cfg, 20)
    assert problem is None and state["step"] == 5 and state["model"]["w"][0] == 5


@pytest.mark.parametrize(("asked", "why"), [
    (dict(model="lenet5"), r"is of model 'mlp', not 'lenet5'; pass another --out"),
    (dict(dataset="synthetic"), r"trained on digits; carrying it on with synthetic would mix two datasets"),
    (dict(steps=4), r"has done 10 steps, more than the 4 asked for"),
])
def test_a_checkpoint_of_another_run_is_refused_with_its_reason(tmp_path: Path, asked: dict, why: str) -> None:
    _save(tmp_path, 10, _cfg(tmp_path))
    state, problem = resume.read(_cfg(tmp_path, **asked), asked.get("steps", 20))
    assert state is None and problem is not None
    with pytest.raises(UserError, match=why):
        raise UserError(problem)


def test_a_resumed_run_is_told_how_to_carry_its_model_on() -> None:
    cfg = config.TrainConfig(model="lenet5", resume="RUN", out="RUN")
    assert resume.model_mismatch("mlp", cfg).endswith("resume with --model mlp")
    assert "paratrain.fit(model=make_net" in resume.model_mismatch("custom", cfg)
    assert resume.model_mismatch("lenet5", cfg) is None and resume.dataset_mismatch(None, cfg) is None
