"""A new user's first day (issue 16): no run overwritten, a trained model that can be used, a record of what
ran, messages that name real fixes, Python errors as UserError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import main_code

import paratrain
from paratrain import UserError
from paratrain.cli import main

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


_main = main_code


# ---- 1. a run is never overwritten ----

def test_a_new_run_on_a_finished_one_is_refused_and_the_old_run_kept(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "r2"
    assert _main(["train", "--quiet", "--no-tensorboard", "--devices", "1", "--steps", "5", "--checkpoint-every",
                  "5", "--out", str(run)]) == 0
    before = {p.name: p.read_bytes() for p in [run / "config.yaml", run / "summary.json"]}
    capsys.readouterr()
    assert _main(["train", "--quiet", "--devices", "1", "--steps", "3", "--lr", "0.01", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a finished run, checkpoints up to step 5" in err, err
    assert f"--resume {run}" in err and "--overwrite" in err, err
    assert {p.name: p.read_bytes() for p in [run / "config.yaml", run / "summary.json"]} == before


def test_overwrite_clears_the_old_run_first(tmp_path: Path) -> None:
    run = tmp_path / "r"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, checkpoint_every=5, out=str(run), **QUICK))
    (run / "notes.txt").write_text("mine\n")  # a file of the user's: not the run's, so kept
    summary = paratrain.fit(None, "digits", paratrain.TrainConfig(steps=3, out=str(run), overwrite=True, **QUICK))
    assert summary["steps"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.pt", "step-00000003.pt"]
    assert "overwrite: false" in (run / "config.yaml").read_text()  # a resume of it will not clear it
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["config"]["overwrite"] is False
    assert paratrain.evaluate(run)["step"] == 3
    assert (run / "notes.txt").read_text() == "mine\n"
    assert all(r["step"] <= 3 for r in map(__import__("json").loads, (run / "metrics.jsonl").read_text().splitlines()))


def test_resume_and_a_fresh_folder_still_work_and_overwrite_with_resume_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "r"
    (run / "unrelated").mkdir(parents=True)  # a folder with other things in it holds no run
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), **QUICK))
    summary = paratrain.fit(None, "digits", paratrain.TrainConfig(resume=str(run), steps=4, **QUICK))
    assert summary["steps"] == 4 and summary["resumed_from_step"] == 2
    with pytest.raises(UserError, match="drop one of them"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(resume=str(run), overwrite=True, **QUICK))


def test_a_run_without_checkpoint_is_not_offered_to_resume_and_torchrun_refuses_overwrite(tmp_path: Path,
                                                                                         monkeypatch) -> None:  # noqa: ANN001
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")  # a run killed before its first checkpoint
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-notes.pt").write_text("")  # and a stray file: no crash on its name
    with pytest.raises(UserError, match="holds an unfinished run; it has no checkpoint to carry on from: pass a new "
                                        "out or add overwrite=True"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), **QUICK))
    # a run that ended before its first step (a script without the __main__ guard) left nothing to keep
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "config.yaml").write_text("steps: 3\n")
    (empty / "parts.yaml").write_text("model: Old\n")
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(empty), **QUICK))
    assert not (empty / "parts.yaml").exists() and "steps: 2" in (empty / "config.yaml").read_text()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="every torchrun start \\(and restart\\) carries on the run in out"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), overwrite=True, **QUICK))
    assert (run / "config.yaml").read_text() == "steps: 3\n"


# ---- 3. a trained model that can be used on new images ----

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


# ---- 4. the record says what ran ----

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


# ---- 5. messages that name the real cause and fix ----

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
    assert "test_first_day.py" in str(e.value) and "in forward: return self.fc(x.flatten(1))" in str(e.value)
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
    assert "(at test_first_day.py:" in str(e.value) and "in _smooth_loss: return" in str(e.value), str(e.value)
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
    assert _main(["train", "--resume", str(mlp), "--width", "32", "--steps", "4"]) == 2
    assert "holds a mlp built with width 16; resume it without changing --width" in capsys.readouterr().err


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


# ---- 6. Python errors are UserError, naming the field or key ----

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


def test_strings_are_read_as_yaml_reads_them() -> None:
    cfg = paratrain.TrainConfig(lr="0.01", steps="100", quiet="true", devices=2, ema="0.999")
    assert (cfg.lr, cfg.steps, cfg.quiet, cfg.devices, cfg.ema) == (0.01, 100, True, "2", 0.999)
    assert cfg.replace(lr=0.5).lr == 0.5  # replace goes through the same door


# ---- 7. small things that cost trust ----

def test_flags_say_what_they_do_once_and_are_never_abbreviated(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-download never download: a missing dataset is an error" in text
    assert "--no-tensorboard write no TensorBoard event files" in text
    assert "(default: per dataset) (default: None)" not in text and "(default: None)" not in text
    assert _main(["train", "--epoch", "1"]) == 2  # once taken as --epochs 1
    err = capsys.readouterr().err
    assert "unrecognized arguments: --epoch 1 (did you mean --epochs?)" in err, err
    assert _main(["search", "--space", "mlp-mnist", "--out", "x", "--trails", "3"]) == 2
    assert "(did you mean --trials?)" in capsys.readouterr().err


@pytest.mark.parametrize("dataset", ["mnist", "cifar10"])
def test_a_failed_download_leaves_nothing(tmp_path: Path, monkeypatch, dataset: str) -> None:  # noqa: ANN001
    import torchvision
    import torchvision.datasets.utils

    def mnist_offline(root: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        (Path(root) / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)  # as torchvision does, then fails
        (Path(root) / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").write_bytes(b"x")
        raise OSError("no network")

    def cifar_offline(url: str, root: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "cifar-10-python.tar.gz").write_bytes(b"x")
        raise OSError("no network")

    monkeypatch.setattr(torchvision.datasets, "MNIST", mnist_offline)
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", cifar_offline)
    monkeypatch.chdir(tmp_path)  # anything written by mistake lands here, not in the checkout
    existing = tmp_path / "mine"
    existing.mkdir()
    for folder, left in ((tmp_path / "new" / "deeper", []), (existing, [])):
        with pytest.raises(UserError, match="could not download"):
            paratrain.fit(None, dataset, paratrain.TrainConfig(data_dir=str(folder), out=str(tmp_path / "r"),
                                                               **QUICK))
        assert not (tmp_path / "new").exists() and sorted(existing.iterdir()) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing else, no run folder either


@pytest.mark.integration
def test_a_logged_run_has_plain_lines_and_a_resume_says_so(tmp_path: Path) -> None:
    from conftest import run_cli

    run = tmp_path / "r"
    proc = run_cli("train", "--devices", "2", "--steps", "4", "--log-every", "2", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = proc.stdout + proc.stderr  # redirected: no progress bar redrawn with carriage returns
    assert "\r" not in logged and "step 2/4  loss" in proc.stdout and "epoch 1/1" in proc.stdout
    assert "leaked semaphore" not in proc.stderr
    proc = run_cli("train", "--resume", str(run), "--steps", "6", "--devices", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == f"paratrain: resuming {run} from its checkpoint of step 4"
    assert "leaked semaphore" not in proc.stderr


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
    with pytest.raises(UserError, match="unknown optimizer 'sgdd'; did you mean 'sgd'\\?; choose one of: adam, sgd"):
        paratrain.fit(Small, "digits", paratrain.TrainConfig(optimizer="sgdd", out=str(tmp_path / "x"), **QUICK))
