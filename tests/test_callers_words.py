"""The smaller things a new user met (issue 35, point 8): messages in the caller's own terms, the names a
Python user looks for, and data refused before any work is done on it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import main_code
from torch import nn

import paratrain
from paratrain import UserError
from paratrain.data import fetch, folder
from paratrain.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import make_shapes  # noqa: E402

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "digits"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, out=str(run), **QUICK))
    return run


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    make_shapes.write(root, per_class=4)  # colour PNGs, 3 classes
    return root


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
    assert (run / "checkpoints" / "last.pt").is_file()


def test_a_python_run_into_a_used_folder_is_refused_in_fields(digits_run: Path) -> None:
    with pytest.raises(UserError) as e:
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, out=str(digits_run), **QUICK))
    message = str(e.value)
    assert f"TrainConfig(resume='{digits_run}')" in message and "add overwrite=True" in message, message
    assert "--" not in message, message


def test_the_command_line_keeps_its_flags(digits_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_code(["train", "--quiet", "--devices", "1", "--steps", "5", "--out", str(digits_run)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {digits_run}" in err and "--overwrite" in err and "TrainConfig" not in err, err


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


def test_eval_of_a_gray_network_on_colour_images_is_refused_before_decoding(
        digits_run: Path, shapes: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("the folder was decoded before the refusal")

    monkeypatch.setattr(folder, "build_cache", no_decoding)
    code = main_code(["eval", str(digits_run), "--dataset", "imagefolder", "--data-dir", str(shapes)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "trained on digits images of 1 channel in 10 classes" in err[0] and "holds colour images" in err[0], err


@pytest.mark.parametrize(("dataset", "title"), [("cifar10", "CIFAR-10"), ("mnist", "MNIST")])
def test_a_folder_of_images_given_as_a_dataset_is_not_downloaded_into(
        shapes: Path, dataset: str, title: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.datasets.utils

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("downloaded into the user's folder")

    monkeypatch.setattr(torchvision.datasets.utils, "download_url", no_download)
    monkeypatch.setattr(torchvision.datasets.MNIST, "download", no_download)
    before = sorted(p.relative_to(shapes) for p in shapes.rglob("*"))
    code = main_code(["train", "--dataset", dataset, "--data-dir", str(shapes), "--steps", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "holds folders of images" in err[0] and f"not {title}'s files" in err[0], err
    assert f"--dataset imagefolder --data-dir {shapes}" in err[0], err
    assert sorted(p.relative_to(shapes) for p in shapes.rglob("*")) == before


def test_a_folder_without_images_may_still_take_a_download(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    for root in (tmp_path, tmp_path / "absent"):  # neither raises: text files, and a folder not there yet
        fetch.refuse_image_folder(root, "CIFAR-10")
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "1.png").write_bytes(b"")
    with pytest.raises(UserError, match="holds folders of images"):
        fetch.refuse_image_folder(tmp_path, "CIFAR-10")


def test_eval_with_a_factory_for_a_built_in_network_says_to_drop_the_flag(digits_run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "nets.py").write_text("from torch import nn\n\ndef mine():\n    return nn.Linear(64, 10)\n")
    code = main_code(["eval", str(digits_run), "--model", f"{tmp_path / 'nets.py'}:mine"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "holds a lenet5 (a built-in network, built from its checkpoint): drop --model" in err[0], err
    assert "model=" not in err[0], err


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
