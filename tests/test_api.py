"""The Python API: a network, data and loss of the user's own, trained, evaluated and loaded back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, max_abs_diff, weights
from torch import nn

import paratrain
from paratrain.cli import main
from paratrain.config import load_yaml

sys.path.insert(0, str(REPO / "examples"))
import own_network  # noqa: E402  (the example a user copies)


class Tiny(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(2 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 3))


def _tensors(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float images whose class is which third of the picture is bright: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.rand(n, 2, 8, 8, generator=g) * 0.2
    for k in range(3):
        x[y == k, :, :, k * 2:k * 2 + 3] += 0.8
    return x, y


def _data() -> dict:
    return {"train": _tensors(512, 0), "val": _tensors(128, 1), "test": _tensors(128, 2)}


def _cfg(tmp_path: Path, **kw: object) -> paratrain.TrainConfig:
    values = dict(devices="1", steps=40, batch_size=64, out=str(tmp_path / "run"), quiet=True, tensorboard=False)
    return paratrain.TrainConfig(**{**values, **kw})


def smooth_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, label_smoothing=0.1)


def test_fit_a_network_data_and_loss_of_ones_own(tmp_path: Path) -> None:
    summary = paratrain.fit(Tiny, _data(), _cfg(tmp_path), loss=smooth_loss,
                            optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    assert summary["model"] == "Tiny" and summary["dataset"] == "custom" and summary["steps"] == 40
    assert summary["test_accuracy"] > 0.9
    # the reported loss is the user's: label smoothing keeps it well above plain cross-entropy's
    ours = paratrain.evaluate(tmp_path / "run", _data(), model=Tiny, loss=smooth_loss)
    plain = paratrain.evaluate(tmp_path / "run", _data(), model=Tiny)
    assert ours["test_accuracy"] == plain["test_accuracy"] == summary["test_accuracy"]
    assert ours["test_loss"] == pytest.approx(summary["test_loss"]) and plain["test_loss"] < 0.8 * ours["test_loss"]
    net = paratrain.load_model(tmp_path / "run", model=Tiny)
    assert not net.training and max_abs_diff(net.state_dict(), weights(tmp_path / "run")) == 0


def test_resume_in_python_starts_from_the_runs_own_options(tmp_path: Path) -> None:
    """TrainConfig(resume=RUN, steps=24) carries the run on with the options in its config.yaml (SGD with
    momentum, lr 0.05, batch 32), as `paratrain train --resume RUN --steps 24` does: 12 + 12 steps equal 24."""
    opts = dict(optimizer="sgd", lr=0.05, momentum=0.9, batch_size=32)
    paratrain.fit(Tiny, _data(), _cfg(tmp_path, steps=24, out=str(tmp_path / "straight"), **opts))
    paratrain.fit(Tiny, _data(), _cfg(tmp_path, steps=12, **opts))
    summary = paratrain.fit(Tiny, _data(), paratrain.TrainConfig(resume=str(tmp_path / "run"), steps=24))
    assert summary["steps"] == 24 and summary["resumed_from_step"] == 12
    saved = load_yaml(tmp_path / "run" / "config.yaml")  # rewritten by the resumed run
    assert (saved["optimizer"], saved["lr"], saved["batch_size"], saved["steps"]) == ("sgd", 0.05, 32, 24)
    assert max_abs_diff(weights(tmp_path / "straight"), weights(tmp_path / "run")) == 0
    with pytest.raises(paratrain.UserError, match="no config.yaml there"):
        paratrain.fit(Tiny, _data(), paratrain.TrainConfig(resume=str(tmp_path)))


def test_registry_models_still_come_from_the_config(tmp_path: Path) -> None:
    summary = paratrain.fit(None, None, _cfg(tmp_path, model="mlp", width=32, depth=1, dataset="digits"))
    assert summary["model"] == "mlp" and summary["dataset"] == "digits"
    net = paratrain.load_model(tmp_path / "run")
    assert sum(p.numel() for p in net.parameters()) == sum(v.numel() for v in weights(tmp_path / "run").values())


def test_a_registry_model_on_ones_own_tensors_loads_back_without_them(tmp_path: Path) -> None:
    data = {k: (x, y.int()) for k, (x, y) in _data().items()}  # int32 labels, as numpy gives them
    summary = paratrain.fit(None, data, _cfg(tmp_path, model="mlp", width=16, depth=1))
    assert summary["dataset"] == "custom"
    net = paratrain.load_model(tmp_path / "run")  # its shapes come from the checkpoint, not from the data
    assert net(torch.zeros(1, 2, 8, 8)).shape == (1, 3)


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: paratrain.fit(None, _data(), _cfg(p, model="custom")), "needs the network's factory"),
    (lambda p: paratrain.fit(Tiny, {"train": _tensors(8, 0)}, _cfg(p)), "a dict with 'train', 'val' and 'test'"),
    (lambda p: paratrain.fit(Tiny, {**_data(), "val": (torch.zeros(4, 3, 8, 8), torch.zeros(4))}, _cfg(p)),
     "images must be N x C x H x W like the training images"),
    (lambda p: paratrain.fit(Tiny, {**_data(), "test": (torch.zeros(4, 2, 8, 8), torch.zeros(4))}, _cfg(p)),
     "labels must be integers"),
    (lambda p: paratrain.fit(Tiny, _data(), _cfg(p, devices="100000")), "devices 100000 asks for more"),
    # a field set that the run's optimizer would not read, in the words of the TrainConfig (Adam by default)
    (lambda p: paratrain.fit(Tiny, _data(), _cfg(p, momentum=0.5)),
     "momentum is not read by optimizer adam, only by optimizer sgd or rmsprop: drop it, or choose one of those"),
    (lambda p: paratrain.fit(Tiny, _data(), _cfg(p, momentum=0.5), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
     "momentum is not read by an optimizer of your own (optimizer=): drop it (your factory sets its own)"),
])
def test_bad_input_is_a_user_error(tmp_path: Path, call: object, message: str) -> None:
    with pytest.raises(paratrain.UserError) as e:
        call(tmp_path)
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_run_of_ones_own_network_needs_its_factory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    paratrain.fit(Tiny, _data(), _cfg(tmp_path, steps=2))
    with pytest.raises(paratrain.UserError, match="pass its factory"):
        paratrain.load_model(tmp_path / "run")
    with pytest.raises(SystemExit):  # not a command-line choice
        main(["train", "--model", "custom", "--steps", "1", "--out", str(tmp_path / "cli")])
    assert "invalid choice: 'custom'" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "4"]) == 2
    assert "carry it on in Python" in capsys.readouterr().err


@pytest.mark.integration
def test_the_example_on_two_workers_equals_one(tmp_path: Path) -> None:
    """examples/own_network.py: a user's CNN and a lambda optimizer (SGD, momentum) on 2 spawned workers
    ends within float noise of 1 worker after 20 steps."""
    one = own_network.main(devices="1", steps=20, out=str(tmp_path / "one"))
    two = own_network.main(devices="2", steps=20, out=str(tmp_path / "two"))
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["model"] == "SmallCNN"
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 3e-6  # measured 2.2e-8
