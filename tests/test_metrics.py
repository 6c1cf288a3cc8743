"""Metrics beside the loss: --metric's built-in names, fit's metrics= (torchmetrics objects and functions), the
same value on N workers as on one device over the same examples, and the one-line refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain import config as C
from paratrain.core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import multilabel  # noqa: E402
import regression  # noqa: E402
import sequences  # noqa: E402

# torchmetrics is imported by the tests that use it, not here: it imports scipy, torchvision's models and
# transformers (6 s), which collecting the tests cost every test process; the fast tests of this file share one
# test process (conftest.py)
HEAVY_IMPORT = "torchmetrics"

QUICK = {"quiet": True, "tensorboard": False, "threads_per_worker": 1}


def _fit(net, data, out: Path, metrics: dict | None = None, **options) -> dict:  # noqa: ANN001
    return paratrain.fit(net, data, paratrain.TrainConfig(out=str(out), **{**QUICK, **options}), metrics=metrics)


def mean_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A metric of one's own: the batch mean of the signed error."""
    return (outputs - targets).mean()


@pytest.mark.parametrize(("metric", "message"), [
    ("maee", r"--metric 'maee' is not a metric paratrain knows; did you mean 'mae'\? Choose from mae, mse"),
    ("mae,mae", "--metric names a metric twice: mae,mae"),
    ("mae,", "--metric '' is not a metric"),
])
def test_a_metric_that_is_not_one_is_one_line(metric: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        C.validate(C.TrainConfig(metric=metric))


@pytest.mark.parametrize(("metrics", "message"), [
    (lambda tm: [tm.MeanAbsoluteError()], r"metrics= takes a dict of names to metrics"),
    (lambda tm: {"loss": tm.MeanAbsoluteError()}, r"'loss' cannot name a metric"),
    (lambda tm: {"my metric": tm.MeanAbsoluteError()}, r"'my metric' cannot name a metric"),
    (lambda tm: {"m": 3}, r"metrics\['m'\] must be a torchmetrics object, a function"),
])
def test_metrics_that_fit_cannot_take_are_one_line(tmp_path: Path, metrics: object, message: str) -> None:
    import torchmetrics

    with pytest.raises(UserError, match=message):
        _fit(regression.build, regression.make_data(n=200), tmp_path / "run", metrics=metrics(torchmetrics),
             devices="1", steps=1)


def test_a_class_metric_on_a_regression_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="metric f1 scores class predictions, and these targets are neither "
                                        "class indices"):
        _fit(regression.build, regression.make_data(n=200), tmp_path / "run", devices="1", steps=1, metric="f1")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_metric_of_more_than_one_number_says_to_reduce_it(tmp_path: Path) -> None:
    import torchmetrics

    per_class = {"f1": torchmetrics.F1Score(task="multiclass", num_classes=3, average="none")}
    with pytest.raises(UserError, match=r"metric f1 computed a Tensor of shape \(3,\), not one number; give it a "
                                        "reduction"):
        _fit(sequences.build, sequences.make_data(n=300), tmp_path / "run", per_class, devices="1", steps=2,
             batch_size=30)


def test_the_metrics_of_a_run_are_those_of_its_network_on_the_split(tmp_path: Path) -> None:
    """Built-in names, a torchmetrics object and a function, in the summary, metrics.jsonl and the epoch line:
    each equals the value computed here over the whole test set with the network the run saved."""
    import torchmetrics

    data = regression.make_data(n=1000)
    summary = _fit(regression.build, data, tmp_path / "run", {"own_mae": torchmetrics.MeanAbsoluteError(),
                                                              "bias": mean_error},
                   devices="1", steps=30, batch_size=32, metric="mae,r2", eval_batch_size=64)
    net = paratrain.load_model(tmp_path / "run", model=regression.build)
    x, y = data["test"]
    with torch.no_grad():
        out = net(x)
    expected = {"mae": (out - y).abs().mean().item(), "own_mae": (out - y).abs().mean().item(),
                "bias": (out - y).mean().item(),
                "r2": 1 - ((out - y) ** 2).sum().item() / ((y - y.mean()) ** 2).sum().item()}
    for name, value in expected.items():
        assert summary[f"test_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-7), name
        assert summary[f"val_{name}"] is not None
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epoch = [r for r in records if "epoch_time_s" in r][-1]
    assert epoch["val_mae"] == pytest.approx(summary["val_mae"], rel=1e-12)


def test_the_epoch_line_and_a_class_metric(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torchmetrics

    data = sequences.make_data(n=600)
    summary = paratrain.fit(sequences.build, data, paratrain.TrainConfig(
        out=str(tmp_path / "run"), devices="1", steps=20, batch_size=30, metric="f1,recall", tensorboard=False))
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ")][-1]
    assert f"val_f1 {summary['val_f1']:.4f}" in line and "val_recall" in line
    net = paratrain.load_model(tmp_path / "run", model=sequences.build)
    with torch.no_grad():
        predicted = net(data["test"][0]).argmax(1)
    f1 = torchmetrics.functional.f1_score(predicted, data["test"][1], task="multiclass", num_classes=3,
                                          average="macro")
    assert summary["test_f1"] == pytest.approx(f1.item(), abs=1e-7)  # float32 here, float64 in the run


def test_a_multi_label_task_with_a_loss_and_a_metric_of_ones_own(tmp_path: Path) -> None:
    """examples/multilabel.py: rows of 0/1 targets, BCE on the logits, torchmetrics' multi-label F1; the
    built-in f1 scores the labels too."""
    import torch.nn.functional as F
    import torchmetrics
    from torchmetrics.wrappers import LambdaInputTransformer

    f1 = {"own_f1": LambdaInputTransformer(torchmetrics.F1Score(task="multilabel", num_labels=multilabel.LABELS,
                                                                average="macro"), transform_pred=torch.sigmoid)}
    summary = paratrain.fit(multilabel.build, multilabel.make_data(n=1500), paratrain.TrainConfig(
        out=str(tmp_path / "run"), devices="1", steps=150, batch_size=64, optimizer="adam", lr=0.003, metric="f1",
        **QUICK), loss=F.binary_cross_entropy_with_logits, metrics=f1)
    assert summary["test_accuracy"] is None and summary["test_own_f1"] > 0.9  # measured 0.98 at 300 steps
    assert summary["test_f1"] == pytest.approx(summary["test_own_f1"], abs=1e-9)  # both macro over the labels


@pytest.mark.parametrize("shape", [(12,), (12, 3)])
def test_a_label_metric_does_not_depend_on_the_batches(shape: tuple[int, ...]) -> None:
    """torchmetrics takes a batch as logits only where some value is outside 0..1: logits near 0 would be
    read as probabilities in one batch and not in another. The built-in f1 of 0/1 targets (one an example:
    binary; a row: multi-label) is given probabilities, so any batching gives one value."""
    from paratrain.data.tensors import tensor_splits
    from paratrain.optimization.metrics import Meter, for_run

    g = torch.Generator().manual_seed(0)
    y = (torch.rand(shape, generator=g) > 0.5).float()
    logits = torch.rand(shape, generator=g) * 0.8 - 0.3  # small: mostly inside 0..1
    logits[0] = 2.0  # one batch holds a value outside
    splits = tensor_splits({s: (torch.zeros(shape[0], 2), y) for s in ("train", "val", "test")})
    values = []
    for size in (12, 4, 1):
        meter = Meter(for_run("f1", None, splits), torch.device("cpu"))
        for start in range(0, shape[0], size):
            meter.update(logits[start:start + size], y[start:start + size])
        values.append(meter.values(None)["f1"])
    assert values[0] == values[1] == values[2], values


def test_a_metric_of_numbers_on_class_targets_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="metric mae compares numbers, and these targets are class indices"):
        _fit(sequences.build, sequences.make_data(n=300), tmp_path / "run", devices="1", steps=1, metric="mae")


# ---- on two workers ----

@pytest.mark.integration
def test_torchmetrics_on_two_workers_equal_one_device_over_the_same_examples(tmp_path: Path) -> None:
    """Unequal shares of the validation and test sets (301 and 299 examples), unpadded: a regression's mean
    absolute error (torchmetrics' and a function) and R^2 under ddp and a pipeline of the registry's mlp. (F1's
    states are counts, summed exactly; its independence of the batching: the default tier.)"""
    import torchmetrics

    data = regression.make_data(n=3000)
    data = {"train": data["train"], "val": (data["val"][0][:301], data["val"][1][:301]),
            "test": (data["test"][0][:299], data["test"][1][:299])}
    mae = {"tm_mae": torchmetrics.MeanAbsoluteError(), "bias": mean_error}
    settings = {"steps": 30, "batch_size": 64, "optimizer": "adam", "lr": 0.003, "metric": "mae,r2"}
    runs = {name: _fit(net, data, tmp_path / name, mae, devices=devices, **settings, **more)
            for name, net, devices, more in (("one", regression.build, "1", {}), ("two", regression.build, "2", {}),
                                             ("mlp-one", "mlp", "1", {"width": 32}),
                                             ("mlp-pipeline", "mlp", "2", {"width": 32, "strategy": "pipeline",
                                                                           "stages": 2, "microbatches": 2}))}
    for a, b in (("one", "two"), ("mlp-one", "mlp-pipeline")):
        for key in ("val_mae", "val_r2", "val_tm_mae", "val_bias", "test_mae", "test_r2", "test_tm_mae", "test_bias"):
            # the weights agree to ~1e-7 after 30 steps (summed in another order); the metric adds nothing to it
            assert runs[a][key] == pytest.approx(runs[b][key], rel=1e-5, abs=1e-6), (a, b, key)
