"""The Python API: a network, data and loss of the user's own, trained, evaluated and loaded back; the record
of what ran (config.yaml, parts.yaml), load_classifier on images as they come, dir(paratrain), and the messages a
Python caller gets, in Python's terms: a mistake in a call as a UserError naming the field or key, a factory,
network or loss of the user's that fails named at the user's line, a run stopped by a signal, a script that
spawns workers without the __main__ guard."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, main_code, max_abs_diff, weights
from torch import nn

import paratrain
from paratrain import UserError
from paratrain.cli import main
from paratrain.config import load_yaml
from paratrain.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import make_shapes  # noqa: E402
import own_network  # noqa: E402  (the example a user copies)

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


_main = main_code


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


def test_the_classifier_takes_images_as_they_come(tmp_path: Path) -> None:
    import torch
    from torchvision.transforms.functional import to_pil_image

    from paratrain.data import load_dataset

    run = tmp_path / "r"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=100, out=str(run), **QUICK))
    clf = paratrain.load_classifier(run)
    x, y = load_dataset("digits").test  # uint8 N x 1 x 28 x 28, as a user would have them
    labels = clf.predict(x)
    # the same transform as training and evaluation: exactly the run's test accuracy
    assert (labels == y).double().mean().item() == pytest.approx(paratrain.evaluate(run)["test_accuracy"], abs=1e-12)
    assert (labels == y).double().mean().item() > 0.8
    pil = [to_pil_image(image) for image in x[:20]]
    assert torch.equal(clf.predict(pil), labels[:20])
    assert torch.equal(clf.predict(x[:20].numpy().transpose(0, 2, 3, 1)), labels[:20])  # channels last
    assert torch.equal(clf.predict(x[:20].float() / 255), labels[:20])  # floats on 0..1
    assert torch.equal(clf.predict(x[3, 0]), labels[3:4])  # one H x W image
    got, probs = clf.predict(x[:20], probabilities=True)
    assert torch.equal(got, labels[:20]) and torch.allclose(probs.sum(1), torch.ones(20))
    # twice the size and in colour: resized and turned grey, still mostly right
    big = [to_pil_image(image).resize((56, 56)).convert("RGB") for image in x[:200]]
    assert (clf.predict(big) == y[:200]).double().mean().item() > 0.7
    assert clf.transform(x[:2]).shape == (2, 1, 32, 32) and clf.classes[7] == "7"
    pil[5].save(tmp_path / "digit.png")
    assert torch.equal(clf.predict([tmp_path / "digit.png", str(tmp_path / "digit.png")]), labels[[5, 5]])
    with pytest.raises(UserError, match="cannot read the image"):
        clf.predict(str(run / "config.yaml"))
    with pytest.raises(UserError, match="must be tensors, NumPy arrays, PIL images or image files"):
        clf.predict(7)


class Small(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))


class Wider(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _sgd(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.05, momentum=0.8)


def test_the_record_names_the_users_network_optimizer_and_loss(tmp_path: Path) -> None:
    import yaml

    run = tmp_path / "r"
    summary = paratrain.fit(Small, "digits", paratrain.TrainConfig(steps=3, out=str(run), **QUICK), optimizer=_sgd,
                            loss=torch.nn.functional.cross_entropy)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optimizer"] == "custom" and saved["lr"] == 0.05  # not the defaults, adam and 0.002
    parts = yaml.safe_load((run / "parts.yaml").read_text())
    assert parts["model"] == "Small" and parts["loss"] == "cross_entropy"
    assert parts["optimizer"]["class"] == "torch.optim.sgd.SGD" and parts["optimizer"]["momentum"] == 0.8
    assert summary["parts"] == parts and summary["model"] == "Small"
    assert paratrain.evaluate(run, model=Small)["model"] == "Small"  # as the summary says, not "custom"
    # carrying it on needs the optimizer again, and says so
    with pytest.raises(UserError, match="optimizer factory of yours: pass it again"):
        paratrain.fit(Small, None, paratrain.TrainConfig(resume=str(run), steps=4, **QUICK))
    assert paratrain.fit(Small, None, paratrain.TrainConfig(resume=str(run), steps=4, **QUICK),
                         optimizer=_sgd)["steps"] == 4


class Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(100, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))  # 784 features, not 100


def test_a_network_that_fails_on_the_data_is_one_line_at_the_users_line(tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:
        paratrain.fit(Broken, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK))
    assert "your network failed on 2 training images of shape (1, 28, 28): RuntimeError" in str(e.value)
    assert "test_api.py" in str(e.value) and "in forward: return self.fc(x.flatten(1))" in str(e.value)
    assert not (tmp_path / "r").exists()  # nothing written
    def five() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 5))

    with pytest.raises(UserError, match=r"returned \(2, 5\) for 2 images; it must return N x K logits, K at least "
                                        r"the 10 classes"):
        paratrain.fit(five, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK))
    with pytest.raises(UserError, match=r"returned \(10,\) for 2 images"):  # a row per image, even with own loss
        paratrain.fit(lambda: torch.nn.Sequential(five(), torch.nn.Flatten(0)), "digits",
                      paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK), loss=lambda z, y: z.sum())
    with pytest.raises(UserError, match="your optimizer factory <lambda> failed: TypeError"):
        paratrain.fit(Small, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK),
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentumm=0.9))


def _smooth_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, y, label_smoothing="0.1")  # a string, not a float


def test_a_loss_that_fails_is_one_line_at_the_users_line(tmp_path: Path) -> None:
    """A loss of the user's is tried on the network's output for 2 training images before any worker starts."""
    with pytest.raises(UserError) as e:
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK),
                      loss=_smooth_loss)
    assert "your loss _smooth_loss failed on the network's output for 2 training images: TypeError" in str(e.value)
    assert "(at test_api.py:" in str(e.value) and "in _smooth_loss: return" in str(e.value), str(e.value)
    with pytest.raises(UserError, match=r"your loss <lambda> returned \(2,\); it must return the batch mean"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "r"), **QUICK),
                      loss=lambda z, y: torch.nn.functional.cross_entropy(z, y, reduction="none"))
    assert not (tmp_path / "r").exists()


def test_the_wrong_factory_or_dataset_is_named_as_such(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "r"
    paratrain.fit(Small, "digits", paratrain.TrainConfig(steps=2, out=str(run), **QUICK))
    for call in (lambda: paratrain.load_model(run, model=Wider),
                 lambda: paratrain.fit(Wider, None, paratrain.TrainConfig(resume=str(run), steps=3, **QUICK))):
        with pytest.raises(UserError, match="do not fit the network your factory builds .*; pass the factory the "
                                            "run was trained with") as e:
            call()
        assert "--model" not in str(e.value)
    # a network whose weights are some of the checkpoint's, alike in name and shape: refused too, not half loaded
    wide = tmp_path / "wide"
    paratrain.fit(Wider, "digits", paratrain.TrainConfig(steps=2, out=str(wide), **QUICK))

    def trunk() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 32))

    with pytest.raises(UserError, match=r"\(3.weight is in the checkpoint and not in this network\); pass the factory"):
        paratrain.fit(trunk, None, paratrain.TrainConfig(resume=str(wide), steps=3, **QUICK))

    def broken() -> torch.nn.Module:
        raise ValueError("no such layer")

    with pytest.raises(UserError, match="your model factory broken failed: ValueError: no such layer"):  # resumed too
        paratrain.fit(broken, None, paratrain.TrainConfig(resume=str(run), steps=3, **QUICK))
    # eval of a grey digits run on colour images: the shapes, not a --model that eval does not have
    grey = tmp_path / "grey"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(grey), **QUICK))
    assert _main(["eval", "--checkpoint", str(grey), "--dataset", "synthetic"]) == 0  # same shape: fine
    capsys.readouterr()
    with pytest.raises(UserError, match=r"trained on digits images of 1x28x28 in 10 classes; the custom test images "
                                         r"are 3x28x28 in 10: evaluate it on images like those of digits"):
        x = torch.randint(0, 255, (8, 3, 28, 28), dtype=torch.uint8)
        pair = (x, torch.arange(8) % 10 + 2)
        paratrain.evaluate(grey, {"train": pair, "val": pair, "test": pair})
    # carrying a digits run on with another dataset is refused before anything runs
    assert _main(["train", "--resume", str(grey), "--dataset", "synthetic", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "trained on digits; carrying it on with synthetic would mix two datasets" in err, err
    # changed model options on resume name the option
    mlp = tmp_path / "mlp"
    paratrain.fit(None, "digits", paratrain.TrainConfig(model="mlp", width=16, steps=2, out=str(mlp), **QUICK))
    record = (mlp / "config.yaml").read_text()
    assert _main(["train", "--resume", str(mlp), "--width", "32", "--steps", "4"]) == 2
    assert "holds a mlp built with width 16; resume it without changing --width" in capsys.readouterr().err
    assert (mlp / "config.yaml").read_text() == record  # refused before the record is rewritten: it carries on
    assert _main(["train", "--resume", str(mlp), "--steps", "4", "--quiet"]) == 0


SCRIPT = '''
import torch
import paratrain

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)

    def forward(self, x):
        if self.training and torch.is_grad_enabled():  # only in training: the check before launch passes
            x = x[..., :10, :10]
        return self.fc(x.flatten(1))

{call}
'''
CALL = 'paratrain.fit(Net, "digits", paratrain.TrainConfig(devices="2", steps=3, out={out!r}, quiet=True))'


@pytest.mark.integration
@pytest.mark.parametrize("guarded", [False, True])
def test_spawned_workers_that_fail_in_the_users_script_say_why(tmp_path: Path, guarded: bool) -> None:
    """Without the __main__ guard the workers re-run the script's fit as they import it; with it, a bug in
    forward that only training meets fails in the workers. Neither is a lost worker that --max-restarts
    would mend, and the message says what is."""
    import subprocess
    import sys

    call = CALL.format(out=str(tmp_path / "run"))
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT.format(call=f'if __name__ == "__main__":\n    {call}' if guarded else call))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "--max-restarts" not in last, proc.stderr[-3000:]
    if guarded:
        assert "mat1 and mat2 shapes cannot be multiplied" in last and "(at mine.py:13 in forward: return " \
            "self.fc(x.flatten(1)))" in last and "the error is in your code" in last, last
    else:
        assert 'put the call under `if __name__ == "__main__":`' in last, last
        assert "bootstrapping phase" not in proc.stderr  # the workers left quietly


@pytest.mark.parametrize(("make", "message"), [
    (lambda: paratrain.TrainConfig(epoch=1), "TrainConfig has no field 'epoch'; did you mean 'epochs'?"),
    (lambda: paratrain.TrainConfig(lr="fast"), "TrainConfig field 'lr' has an invalid value 'fast'"),
    (lambda: paratrain.TrainConfig(steps=2.5), "TrainConfig field 'steps' has an invalid value 2.5"),
    (lambda: paratrain.TrainConfig(5), "TrainConfig takes keyword arguments"),
    (lambda: paratrain.fit(Small(), "digits"), "pass Small, not Small()"),
    (lambda: paratrain.fit(Small, "digits", optimizer=torch.optim.SGD(Small().parameters(), lr=0.1)),
     "optimizer= takes a factory of the parameters"),
    (lambda: paratrain.fit(Small, "digits", loss="cross_entropy"), "loss= must be callable"),
    (lambda: paratrain.fit(Small, "digits", {"steps": 3}), "config must be a paratrain.TrainConfig, not a dict"),
    (lambda: paratrain.fit(Small, {"train": PAIR, "valid": PAIR, "test": PAIR}),
     "data has no 'val' (is 'valid' meant to be 'val'?)"),
    (lambda: paratrain.fit(Small, {"train": PAIR, "test": PAIR}), "data has no 'val'; give a dict"),
    (lambda: paratrain.fit(Small, {"train": PAIR, "val": PAIR[0], "test": PAIR}),
     r"data\['val'\] must be an \(inputs, targets\) pair"),
    (lambda: paratrain.load_model("runs/x", model=Small()), "pass Small, not Small()"),
])
def test_python_mistakes_are_user_errors(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")
                       if "\\" not in message else message):
        make()


PAIR = (torch.zeros(4, 1, 28, 28, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))


def test_what_a_python_user_sees(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "r"
    paratrain.fit(Small, "digits", paratrain.TrainConfig(steps=3, out=str(run), quiet=True, tensorboard=False,
                                                         devices="1"),
                  optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5, weight_decay=1e-4))
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("test_accuracy ") and out.splitlines()[-1].endswith(f"-> {run}")
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["optimizer"], saved["lr"], saved["momentum"], saved["weight_decay"]) == ("custom", 0.05, 0.5, 1e-4)
    with pytest.raises(UserError, match="pass the factory the run was trained with, Small"):
        paratrain.load_model(run, model=Wider)
    with pytest.raises(UserError, match="a resumed run carries on in its own folder"):
        paratrain.fit(Small, None, paratrain.TrainConfig(resume=str(run), out=str(tmp_path / "other"), **QUICK))
    assert _main(["train", "--resume", str(run), "--out", str(tmp_path / "other")]) == 2
    assert "drop --out" in capsys.readouterr().err and not (tmp_path / "other").exists()
    with pytest.raises(UserError, match="unknown optimizer 'sgdd'; did you mean 'sgd'\\?; choose one of: adam, "
                                        "adamw, sgd"):
        paratrain.fit(Small, "digits", paratrain.TrainConfig(optimizer="sgdd", out=str(tmp_path / "x"), **QUICK))


def test_a_python_run_stopped_by_a_signal_says_how_to_go_on_in_python(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    update = Trainer._update

    def update_then_ctrl_c(self: Trainer) -> None:
        update(self)
        if self.state.step == 3:  # as Ctrl-C at the third step
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "_update", update_then_ctrl_c)
    run = tmp_path / "r"
    with pytest.raises(UserError) as e:
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=50, out=str(run), **QUICK))
    message = str(e.value)
    assert e.value.code == 130 and "stopped by SIGINT at step 4" in message, message
    assert f"paratrain.fit(..., TrainConfig(resume='{run}'))" in message and "--" not in message, message
    assert (run / "checkpoints" / "step-00000004" / "meta.pt").is_file()


def test_a_wrong_factory_for_a_built_in_network_is_named(digits_run: Path) -> None:
    def mine() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    with pytest.raises(UserError, match=r"holds a lenet5 \(a built-in network\), and the network mine builds does "
                                        r"not take its weights; leave out model="):
        paratrain.load_model(digits_run, model=mine)
    assert isinstance(paratrain.load_model(digits_run), nn.Module)  # without it, it loads


def test_dir_lists_the_names_imported_on_first_use() -> None:
    names = dir(paratrain)
    assert {"fit", "evaluate", "load_model", "load_classifier", "TrainConfig", "UserError"} <= set(names)
    assert names == sorted(names)


def test_evaluate_takes_the_summary_fit_returned_and_eval_scores_a_folder_whole(
        tmp_path: Path, shapes: Path, capsys: pytest.CaptureFixture) -> None:
    net = ROOT / "examples" / "residual_cnn.py"
    summary = paratrain.fit(f"{net}:build", str(shapes), paratrain.TrainConfig(steps=2, batch_size=4,
                                                                               out=str(tmp_path / "r"), **QUICK))
    other = tmp_path / "other"
    make_shapes.write(other, per_class=5, seed=1)
    assert paratrain.evaluate(summary, other)["test_examples"] == 15  # every image of another folder
    assert paratrain.evaluate(summary, shapes)["test_examples"] < 12  # its own folder: the images it held out
    assert main_code(["eval", str(tmp_path / "r"), "--data-dir", str(other)]) == 0
    assert "(15 imagefolder test images" in capsys.readouterr().out  # all of it, none held out
    with pytest.raises(UserError, match="run must be a run's folder"):
        paratrain.evaluate(3)


def test_eval_data_dir_scores_that_folder_for_a_run_on_tensors(tmp_path: Path, shapes: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    net = ROOT / "examples" / "residual_cnn.py"
    g = torch.Generator().manual_seed(0)
    data = {s: (torch.randint(0, 255, (n, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(n) % 3)
            for s, n in (("train", 24), ("val", 6), ("test", 6))}
    paratrain.fit(f"{net}:build", data, paratrain.TrainConfig(steps=2, batch_size=4, out=str(tmp_path / "r"), **QUICK))
    capsys.readouterr()
    assert main_code(["eval", str(tmp_path / "r"), "--model", f"{net}:build", "--data-dir", str(shapes)]) == 0
    assert "(12 imagefolder test images" in capsys.readouterr().out  # the folder named, whole; not the run's 6
