"""The command line's options for tasks other than images: --loss, --standardize, the bundled diabetes and tokens
datasets and their recipes, multi-label targets, and load_predictor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import main_code

import paratrain
from paratrain import config as C
from paratrain.config import recipes
from paratrain.core.errors import UserError
from paratrain.data import load_dataset

QUICK = ["--no-tensorboard", "--quiet", "--devices", "1"]


def _multilabel(path: Path, n: int = 1200) -> Path:
    """16 features on a scale far from 0..1 (5 +- 3), 4 labels each 1 on one side of a random hyperplane."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g) * 3 + 5
    y = ((x - 5) @ torch.randn(16, 4, generator=g) > 0).float()
    np.savez(path, x=x.numpy(), y=y.numpy())
    return path


def test_the_bundled_datasets_are_tensors_with_their_own_held_out_rows() -> None:
    table = load_dataset("diabetes")
    assert table.kind == "tensors" and table.input_shape == (10,) and not table.classification
    assert [len(s[1]) for s in (table.train, table.val, table.test)] == [357, 40, 45]  # 442 rows
    assert table.train[0].mean(0).abs().max() < 1e-5  # standardised with the training rows' statistics
    assert 25 <= float(table.test[1].min()) and float(table.test[1].max()) <= 346  # the target in its own units
    tokens = load_dataset("tokens")
    assert tokens.input_shape == (12,) and tokens.num_classes == 3 and tokens.vocabulary == 20
    assert torch.equal(load_dataset("tokens").test[0], tokens.test[0])  # the same rows every time


@pytest.mark.parametrize("name", ["diabetes-mlp", "tokens-gru"])
def test_the_recipes_of_other_tasks_validate(name: str) -> None:
    cfg = C.validate(C.from_dict(recipes.load(name)))
    assert cfg.metric


def test_the_diabetes_recipe_learns_its_table_and_evaluates_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main_code(["train", "--recipe", "diabetes-mlp", "--out", str(run), *QUICK]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # a linear regression explains about half of the variance; measured R^2 0.41 on the test rows, MAE 45
    assert summary["test_r2"] > 0.3 and summary["test_mae"] < 55 and summary["test_accuracy"] is None
    capsys.readouterr()
    assert main_code(["eval", str(run)]) == 0
    line = capsys.readouterr().out
    assert f"test_mae {summary['test_mae']:.4f}" in line and "45 diabetes test examples" in line


@pytest.mark.parametrize(("flags", "message"), [
    (["--dataset", "digits", "--loss", "mse"], "--loss mse compares numbers, and images are classified"),
    (["--dataset", "digits", "--standardize"], "--standardize scales the features of tensors; images are normalised"),
    (["--dataset", "tokens", "--model", "gru", "--standardize"], "--standardize scales float features; these inputs "
                                                                 "are torch.int64"),
    (["--dataset", "diabetes", "--loss", "l1", "--label-smoothing", "0.1"],
     "--label-smoothing smooths the cross-entropy's class targets, not --loss l1"),
    (["--dataset", "diabetes", "--loss", "huber"], "invalid choice: 'huber'"),
])
def test_a_loss_or_scaling_the_data_cannot_take_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            flags: list[str], message: str) -> None:
    assert main_code(["train", *flags, "--steps", "1", "--out", str(tmp_path / "run"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_multi_label_targets_train_with_bce_standardised_and_predict(tmp_path: Path) -> None:
    data = _multilabel(tmp_path / "labels.npz")
    run = tmp_path / "run"
    assert main_code(["train", "--recipe", "multilabel-mlp", "--data-dir", str(data), "--epochs", "8", "--out",
                      str(run), *QUICK]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_f1"] > 0.9 and summary["test_accuracy"] is None  # measured 0.96
    predictor = paratrain.load_predictor(run)
    assert isinstance(predictor, paratrain.Predictor)
    arrays = np.load(data)
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    # the network takes standardised features: predict applies the training rows' statistics itself
    scores = predictor.predict(x[:200])
    assert scores.shape == (200, 4)
    agree = ((scores > 0).float() == y[:200]).float().mean().item()
    assert agree > 0.9, agree
    raw = paratrain.load_model(run)
    with torch.no_grad():  # without the statistics the scale of the features (5 +- 3) misleads it
        assert not torch.allclose(raw(x[:200]), scores)
    again = paratrain.evaluate(run, data)
    assert again["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    assert again["test_f1"] == pytest.approx(summary["test_f1"], abs=1e-6)
    with torch.no_grad():  # the reported loss is the binary cross-entropy on the logits
        assert F.binary_cross_entropy_with_logits(scores, y[:200]).item() < 0.3


def test_a_predictor_of_classes_and_of_a_regression(tmp_path: Path) -> None:
    assert main_code(["train", "--recipe", "tokens-gru", "--epochs", "3", "--out", str(tmp_path / "t"), *QUICK]) == 0
    tokens = load_dataset("tokens")
    predictor = paratrain.load_predictor(tmp_path / "t")
    classes, probs = predictor.predict(tokens.test[0][:50], probabilities=True)
    assert classes.shape == (50,) and probs.shape == (50, 3) and (classes == tokens.test[1][:50]).float().mean() > 0.8
    assert predictor.predict(tokens.test[0][0]).shape == (1,)  # one example
    with pytest.raises(UserError, match=r"trained on integer inputs \(token ids\); got torch.float32"):
        predictor.predict(tokens.test[0][:2].float())
    with pytest.raises(UserError, match=r"takes examples of shape \(12,\); got \(2, 11\)"):
        predictor.predict(tokens.test[0][:2, :11])
    with pytest.raises(UserError, match="knows token ids 0..19; these reach 0..20"):
        predictor.predict(torch.tensor([[20] + [0] * 11]))
    with pytest.raises(UserError, match="paratrain.load_predictor"):
        paratrain.load_classifier(tmp_path / "t")
    assert main_code(["train", "--dataset", "diabetes", "--model", "mlp", "--width", "16", "--steps", "5", "--out",
                      str(tmp_path / "d"), *QUICK]) == 0
    numbers = paratrain.load_predictor(tmp_path / "d").predict(load_dataset("diabetes").test[0][:3])
    assert numbers.shape == (3,)
    assert isinstance(paratrain.load_predictor(_digits_run(tmp_path)), paratrain.Classifier)


def _digits_run(tmp_path: Path) -> Path:
    run = tmp_path / "digits"
    assert main_code(["train", "--steps", "2", "--out", str(run), *QUICK]) == 0
    return run


def test_report_and_plan_of_a_regression_use_its_loss_and_its_own_network(tmp_path: Path) -> None:
    """`paratrain report` of runs without accuracy shows their test loss; the plan models the bench's network as
    built for its data (an MLP over the table's 10 features), not for images."""
    from paratrain.measure import bench, plot
    from paratrain.measure import scaling as forecast

    for name, workers in (("one", "1"), ("two", "2")):
        assert main_code(["train", "--dataset", "diabetes", "--model", "mlp", "--width", "16", "--steps", "6",
                          "--log-every", "2", "--out", str(tmp_path / name), "--no-tensorboard", "--quiet",
                          "--devices", workers, "--oversubscribe"]) == 0
    rows = [bench.result_from_run(tmp_path / name) for name in ("one", "two")]
    text = plot.write_report({"context": bench.context(), "results": rows}, tmp_path, rates="summary").read_text()
    loss = json.loads((tmp_path / "one" / "summary.json").read_text())["test_loss"]
    assert "| test loss |" in text and f"{loss:,.4f}" in text, text
    sizes = forecast.block_sizes_of(forecast.bench_network("mlp", {"dataset": "diabetes", "width": 16})[0])
    assert sum(sizes) == (10 * 16 + 16) + (16 * 16 + 16) + (16 + 1)  # before: for 28x28 images
