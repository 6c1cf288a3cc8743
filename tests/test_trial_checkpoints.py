"""What a search's finished trials keep (--keep-trial-checkpoints, search/keep.py): the best one its
checkpoints, the others their weights (or nothing); a running trial is never touched."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch
from conftest import main_code, newest_state

import paratrain
from paratrain import config
from paratrain.checkpoint import files as checkpoint
from paratrain.data import load_dataset
from paratrain.search import keep
from paratrain.search.runner import train_one

VALUES = {0: 0.5, 1: 0.9, 2: 0.7}  # trial 1 is the best


@pytest.fixture
def search(tmp_path: Path) -> tuple[Path, optuna.Study]:
    """Three finished trials trained with SGD momentum (which keeps optimizer state) and one still running."""
    out = tmp_path / "search"
    study = optuna.create_study(direction="maximize")
    dist = {"lr": optuna.distributions.CategoricalDistribution([0.01, 0.02, 0.03, 0.04])}
    data = load_dataset("digits")
    for number, lr in enumerate([0.01, 0.02, 0.03, 0.04]):
        cfg = config.validate(config.TrainConfig(out=str(out / "trials" / f"{number:04d}"), steps=4, optimizer="sgd",
                                                 momentum=0.9, lr=lr, checkpoint_every=2, quiet=True,
                                                 tensorboard=False))
        train_one(cfg, data, 0, 1, "cpu", 1)
        state = optuna.trial.TrialState.RUNNING if number == 3 else optuna.trial.TrialState.COMPLETE
        study.add_trial(optuna.trial.create_trial(params={"lr": lr}, distributions=dist, state=state,
                                                  value=VALUES.get(number)))
    return out, study


def _folder(out: Path, number: int) -> Path:
    return out / "trials" / f"{number:04d}"


def test_best_keeps_the_best_trials_checkpoints_and_the_others_weights(search: tuple, capsys) -> None:  # noqa: ANN001
    out, study = search
    before = {n: checkpoint.load(_folder(out, n)) for n in range(4)}
    keep.tidy(study, out, "best")
    for n in (1, 3):  # the best, and the running one: as they were, each resumable
        assert len(list((_folder(out, n) / "checkpoints").glob("step-*"))) == 2
        assert newest_state(_folder(out, n))["optimizer"]  # its optimizer state: it can carry on
    for n in (0, 2):
        files = sorted(p.name for p in (_folder(out, n) / "checkpoints").iterdir())
        assert files == ["last.pt", "weights-only.txt"], files
        state = checkpoint.load(_folder(out, n))
        assert state["optimizer"] is None and "scheduler" not in state and state["step"] == 4
        assert all(torch.equal(state["model"][k], before[n]["model"][k]) for k in state["model"])
        # the weights still load and score
        assert isinstance(paratrain.load_model(_folder(out, n)), torch.nn.Module)
        assert paratrain.evaluate(_folder(out, n))["test_examples"] > 0
    capsys.readouterr()
    assert main_code(["train", "--resume", str(_folder(out, 0)), "--steps", "6", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kept only its weights" in err[0] and "--keep-trial-checkpoints all" in err[0], err
    assert f"--config {_folder(out, 0) / 'config.yaml'} --out NEW" in err[0], err
    assert "steps: 4" in (_folder(out, 0) / "config.yaml").read_text()  # refused before its record was rewritten
    # a new run into the folder is not offered --resume
    assert main_code(["train", "--steps", "2", "--quiet", "--out", str(_folder(out, 0))]) == 2
    err = capsys.readouterr().err
    assert "--resume" not in err and "pass a new --out" in err, err
    with pytest.raises(paratrain.UserError, match="kept only its weights"):  # and in Python
        paratrain.fit(None, "digits", paratrain.TrainConfig(resume=str(_folder(out, 2)), steps=6, quiet=True))
    assert main_code(["train", "--resume", str(_folder(out, 1)), "--steps", "6", "--quiet"]) == 0  # the best goes on
    keep.tidy(study, out, "best")  # done again: nothing changes
    assert sorted(p.name for p in (_folder(out, 0) / "checkpoints").iterdir()) == ["last.pt", "weights-only.txt"]


def test_none_keeps_no_finished_trials_checkpoint_and_all_keeps_every_one(search: tuple) -> None:
    out, study = search
    keep.tidy(study, out, "all")
    assert all(len(list((_folder(out, n) / "checkpoints").glob("step-*"))) == 2 for n in range(4))
    keep.tidy(study, out, "none")
    assert [n for n in range(4) if (_folder(out, n) / "checkpoints").exists()] == [3]  # only the running one
    assert all((_folder(out, n) / "summary.json").is_file() for n in range(3))  # the record stays


def test_an_unknown_policy_is_one_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    space = tmp_path / "space.yaml"
    space.write_text("fixed: {model: mlp, dataset: digits}\nparams:\n  lr: [0.01, 0.02]\n")
    assert main_code(["search", "--space", str(space), "--out", str(tmp_path / "s"),
                      "--keep-trial-checkpoints", "some"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paratrain: error: unknown --keep-trial-checkpoints 'some'; choose one of: none, best, all"], err
