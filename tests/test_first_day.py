"""A new user's first day (issue 16): no run overwritten, a trained model that can be used, a record of what
ran, messages that name real fixes, Python errors as UserError."""

from __future__ import annotations

from pathlib import Path

import pytest

import paratrain
from paratrain import UserError
from paratrain.cli import main

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code)


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
