"""What a new user met with a real network (torchvision's ResNet-18 on their own images, issue 35): the
pipeline's cost probe on a BatchNorm-tailed network, and a network that fails while it is planned (a model
factory that raises: one UserError naming its line, under every strategy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchvision
from torch import nn

import paratrain
from paratrain import config as C
from paratrain.components.parts import Parts
from paratrain.core.errors import UserError
from paratrain.data import load_dataset
from paratrain.parallel.strategies.pp import cut

DIGITS = load_dataset("digits")
QUICK = {"quiet": True, "tensorboard": False}


def resnet_layers() -> nn.Sequential:
    """torchvision's ResNet-18 for 1-channel images as a sequence of layers: at 28x28 (32x32 alike) its last
    block sees a 1x1 map, where BatchNorm in training mode fails on a batch of one ("Expected more than 1 value
    per channel")."""
    r = torchvision.models.resnet18(num_classes=10)
    r.conv1 = nn.Conv2d(1, 64, 7, stride=2, padding=3, bias=False)
    return nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4, r.avgpool,
                         nn.Flatten(), r.fc)


class Boom(nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        raise ValueError("shapes do not match")


def test_the_pipeline_cuts_a_resnet_that_ends_in_batchnorm_on_a_1x1_map() -> None:
    cfg = C.TrainConfig(dataset="digits", strategy="pipeline", stages=2, batchnorm="local", model="custom")
    cfg, table = cut(cfg, DIGITS, Parts(model=resnet_layers))
    assert len(cfg.split.split(",")) == 1 and "Conv2d, BatchNorm2d" in table


def test_a_network_that_fails_while_its_cost_is_counted_is_one_line_naming_its_line() -> None:
    cfg = C.TrainConfig(dataset="digits", strategy="pipeline", stages=2, batchnorm="local", model="custom")
    with pytest.raises(UserError) as e:
        cut(cfg, DIGITS, Parts(model=lambda: nn.Sequential(nn.Flatten(), Boom())))
    message = str(e.value)
    assert "\n" not in message and "ValueError: shapes do not match" in message
    assert "test_real_network.py" in message and "in forward" in message


class Raising(nn.Sequential):
    def __init__(self) -> None:
        raise ValueError("no such layer")  # the user's line the error names


@pytest.mark.parametrize("options", [dict(devices="1"), dict(strategy="tower", devices="2"),
                                     dict(strategy="pipeline", stages=2, devices="2"),
                                     dict(strategy="hybrid", stages=2, devices="4", oversubscribe=True)])
def test_a_raising_factory_is_one_user_error_naming_its_line_under_every_strategy(tmp_path: Path,
                                                                                   options: dict) -> None:
    with pytest.raises(UserError) as e:
        paratrain.fit(Raising, "digits", paratrain.TrainConfig(out=str(tmp_path / "r"), steps=2, **QUICK, **options))
    assert str(e.value).startswith("your model factory Raising failed: ValueError: no such layer (at "
                                   "test_real_network.py:"), str(e.value)
    assert 'in __init__: raise ValueError("no such layer")' in str(e.value)


@pytest.mark.integration
def test_a_pipeline_of_a_resnet_trains(tmp_path: Path) -> None:
    cfg = paratrain.TrainConfig(dataset="digits", strategy="pipeline", stages=2, devices="2", batchnorm="local",
                                steps=4, batch_size=16, quiet=True, tensorboard=False, out=str(tmp_path / "run"))
    summary = paratrain.fit(resnet_layers, config=cfg)
    assert summary["steps"] == 4 and summary["world_size"] == 2 and summary["val_loss"] is not None


def test_eval_of_a_python_trained_network_speaks_the_command_lines_terms(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`paratrain eval RUN` of a run trained from Python on a network of the user's: without the network, one
    line that names --model FILE.py:FACTORY (not Python's model=make_net); with it, the run is scored."""
    import importlib.util

    from paratrain.cli import main

    source = tmp_path / "mynet.py"
    source.write_text("from torch import nn\n\n\ndef build():\n"
                      "    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n")
    spec = importlib.util.spec_from_file_location("mynet", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = tmp_path / "run"
    paratrain.fit(module.build, config=paratrain.TrainConfig(dataset="digits", steps=3, devices="1", quiet=True,
                                                             tensorboard=False, out=str(run)))
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --model FILE.py:FACTORY" in err[0] and "model=make_net" not in err[0], err
    for wrong, said in (("lenet5", "--model lenet5: name the file and function that build your network"),
                        (f"{source}:nothere", "has no 'nothere'; it defines: build")):
        assert main(["eval", str(run), "--model", wrong]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert main(["eval", str(run), "--model", f"{source}:build"]) == 0
    assert "test_accuracy" in capsys.readouterr().out
    with pytest.raises(UserError, match="pass its factory, model=make_net"):  # and Python's terms in Python
        paratrain.evaluate(run)
