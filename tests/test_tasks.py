"""Tasks other than image classification, through paratrain.fit: tensors of any shape (kind "tensors"), the loss
deciding the task (cross-entropy for class indices, the mean squared error for floats, any loss of the user's),
accuracy only where it means something. The regression and the sequence model are the examples' own
(examples/regression.py, examples/sequences.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import kill_a_worker_midway, max_abs_diff, weights
from torch import nn

import paratrain
from paratrain.components.inputs import tensor_splits
from paratrain.core.errors import UserError
from paratrain.data import Splits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import regression  # noqa: E402
import sequences  # noqa: E402

QUICK = {"quiet": True, "tensorboard": False, "threads_per_worker": 1, "log_every": 1}
# far from divergence: Adam at 0.003 on the regression, SGD with momentum where a test wants it
REGRESSION = {"steps": 40, "batch_size": 64, "optimizer": "adam", "lr": 0.003, "checkpoint_every": 10,
              "keep_checkpoints": 100}
SEQUENCES = {"steps": 30, "batch_size": 60, "optimizer": "adam", "lr": 0.01, "checkpoint_every": 10,
             "keep_checkpoints": 100}


def _fit(net, data, out: Path, **options) -> dict:  # noqa: ANN001
    return paratrain.fit(net, data, paratrain.TrainConfig(out=str(out), **{**QUICK, **options}))


# ---- the data: checked in one line each ----

def _pairs(**changed: tuple[torch.Tensor, torch.Tensor]) -> dict:
    base = {"train": (torch.randn(8, 3), torch.randn(8)), "val": (torch.randn(2, 3), torch.randn(2)),
            "test": (torch.randn(2, 3), torch.randn(2))}
    return {**base, **changed}


@pytest.mark.parametrize(("changed", "message"), [
    ({"train": (torch.randn(0, 3), torch.randn(0))}, r"data\['train'\] holds no examples"),
    ({"val": (torch.randn(3, 3), torch.randn(2))}, r"data\['val'\] has 3 inputs and 2 targets"),
    ({"test": (torch.randn(2, 4), torch.randn(2))}, r"data\['test'\] inputs are \(4,\) an example, the training "
                                                     r"inputs \(3,\)"),
    ({"val": (torch.randn(2, 3), torch.randn(2, 2))}, r"data\['val'\] targets are \(2,\) an example"),
    ({"train": (torch.tensor([[0.0, 1.0, float("nan")]] * 8), torch.randn(8))}, r"inputs hold NaN or inf \(row 0"),
    ({"test": (torch.randn(2, 3), torch.tensor([1.0, float("inf")]))}, r"targets hold NaN or inf \(row 1"),
    ({"train": (torch.randn(8, 3, dtype=torch.complex64), torch.randn(8))}, "give real numbers"),
    ({"train": (torch.randn(8, 3), torch.tensor([0, 1, -1, 2, 0, 1, 2, 0]))}, "class indices, and must be 0..K-1"),
])
def test_bad_tensors_are_one_line(changed: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        tensor_splits(_pairs(**changed))


def test_tensors_keep_their_shapes_and_say_what_task_they_are() -> None:
    table = tensor_splits(_pairs())
    assert not table.images and table.input_shape == (3,) and table.target_shape == ()
    assert not table.classification and table.num_outputs == 1
    tokens = tensor_splits({k: (torch.randint(0, 9, (4, 12)), torch.tensor([0, 2, 1, 2])) for k in
                            ("train", "val", "test")})
    assert tokens.classification and tokens.num_classes == 3 and tokens.num_outputs == 3
    assert tokens.train[0].dtype == torch.int64  # token ids stay integers
    grid = tensor_splits({k: (torch.randn(4, 5).double(), torch.randn(4, 2, 3).double()) for k in
                          ("train", "val", "test")})
    assert grid.train[0].dtype == grid.train[1].dtype == torch.float32 and grid.num_outputs == 6
    info = grid.shape_info()
    assert info["kind"] == "tensors" and info["input_shape"] == [5] and info["target_shape"] == [2, 3]
    empty = Splits.shaped_like("custom", info)
    assert empty.input_shape == (5,) and empty.target_shape == (2, 3) and not empty.images


def _wrong_width(input_shape: tuple[int, ...]) -> nn.Module:
    return nn.Linear(input_shape[0], 1)  # N x 1 against N targets: MSE would broadcast to N x N


def _asks_for_channels(channels: int, num_classes: int) -> nn.Module:
    return nn.Linear(channels, num_classes)


def _asks_for_classes(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Linear(input_shape[0], num_classes)


@pytest.mark.parametrize(("model", "options", "message"), [
    (_wrong_width, {}, r"returned \(2, 1\) for 2 examples and the targets are \(2,\): the default loss \(mean "
                       "squared error\\) needs the same shape"),
    (_asks_for_channels, {}, "asks for channels, which only images have"),
    (_asks_for_classes, {}, "asks for num_classes, and these targets are not class indices: take num_outputs"),
    (None, {"model": "lenet5"}, "model 'lenet5' takes images; this data is tensors of shape"),
    (regression.build, {"hflip": True}, "hflip=True is for images; this data is tensors"),
    (regression.build, {"test_flip": True}, "test_flip=True is for images"),
    (regression.build, {"random_crop": True}, "random_crop=True is for images"),
    (regression.build, {"label_smoothing": 0.1}, "label_smoothing smooths class targets"),
    ("mlp", {"label_smoothing": 0.1}, "label_smoothing smooths class targets"),  # the registry's network too
])
def test_what_a_task_cannot_take_is_one_line(tmp_path: Path, model, options: dict, message: str) -> None:  # noqa: ANN001
    with pytest.raises(UserError, match=message):
        _fit(model, _pairs(), tmp_path / "run", steps=1, batch_size=4, devices="1", **options)


@pytest.mark.parametrize(("net", "message"), [
    (lambda: nn.Linear(3, 2), r"returned \(2, 2\) for 2 examples and the targets are token ids \(2, 2\): the "
                              r"cross-entropy needs a score for every token of the vocabulary at every position"),
    ("mlp", "model 'mlp' gives numbers, and these targets are integers of shape"),
])
def test_integer_targets_that_are_not_class_indices_are_token_ids(tmp_path: Path, net, message: str) -> None:  # noqa: ANN001
    """Integer targets a row an example are token ids: the cross-entropy over every position judges them, so a
    network must give a score a token at every position."""
    data = {k: (torch.randn(8, 3), torch.randint(0, 5, (8, 2))) for k in ("train", "val", "test")}
    with pytest.raises(UserError, match=message):
        _fit(net, data, tmp_path / "run", steps=1, batch_size=4, devices="1")


def test_float_labels_on_images_say_they_make_a_regression(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images = torch.rand(16, 1, 8, 8)
    data = {k: (images, torch.arange(16).float() % 2) for k in ("train", "val", "test")}
    summary = paratrain.fit("mlp", data, paratrain.TrainConfig(out=str(tmp_path / "run"), steps=2, batch_size=8,
                                                               devices="1", tensorboard=False, width=8))
    assert summary["test_accuracy"] is None
    assert "the labels are floats, so this is a regression" in capsys.readouterr().err


# ---- on one device ----

def test_a_regression_trains_with_the_mean_squared_error_and_reports_no_accuracy(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture) -> None:
    data = regression.make_data()
    summary = _fit(regression.build, data, tmp_path / "run", devices="1", **{**REGRESSION, "steps": 200})
    variance = data["test"][1].var().item()
    assert summary["test_accuracy"] is None and summary["val_accuracy"] is None
    assert summary["test_loss"] < 0.3 * variance, (summary["test_loss"], variance)  # measured 0.17 of it
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("test_loss ") and "accuracy" not in line
    # the run's network, loaded back, gives that loss on the test set
    net = paratrain.load_model(tmp_path / "run", model=regression.build)
    with torch.no_grad():
        assert F.mse_loss(net(data["test"][0]), data["test"][1]).item() == pytest.approx(summary["test_loss"],
                                                                                         rel=1e-5)
    parts = (tmp_path / "run" / "parts.yaml").read_text()
    assert "mse_loss (paratrain's default)" in parts


def test_the_registry_mlp_takes_any_width_and_a_loss_of_ones_own(tmp_path: Path) -> None:
    data = regression.make_data(n=600)
    mse = _fit("mlp", data, tmp_path / "mlp", devices="1", steps=20, batch_size=32, width=32)
    assert mse["test_accuracy"] is None
    assert mse["test_loss"] < data["test"][1].var().item()  # better than the mean; measured 0.35 of the variance
    own = paratrain.fit("mlp", data, paratrain.TrainConfig(out=str(tmp_path / "own"), steps=20, batch_size=32,
                                                           width=32, devices="1", **QUICK), loss=F.l1_loss)
    net = paratrain.load_model(tmp_path / "own")  # the registry's: rebuilt from the checkpoint's shapes
    with torch.no_grad():  # judged by the loss it trained with: the mean absolute error
        assert F.l1_loss(net(data["test"][0]), data["test"][1]).item() == pytest.approx(own["test_loss"], rel=1e-5)


def test_one_number_an_example_an_import_path_and_the_console(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Inputs of one number an example through the registry's mlp; a factory named by its path; the step and
    epoch lines of a regression, which give no accuracy."""
    x = torch.randn(400, generator=torch.Generator().manual_seed(0))
    data = {"train": (x[:320], 2 * x[:320]), "val": (x[320:360], 2 * x[320:360]), "test": (x[360:], 2 * x[360:])}
    line = paratrain.fit("mlp", data, paratrain.TrainConfig(out=str(tmp_path / "line"), steps=100, batch_size=32,
                                                            width=16, devices="1", tensorboard=False, log_every=50,
                                                            optimizer="adam", lr=0.01))
    assert line["test_loss"] < 0.5 * data["test"][1].var().item()
    out = capsys.readouterr().out
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    epochs = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert steps and epochs and not any("accuracy" in ln for ln in steps + epochs), out
    assert "val_loss" in epochs[0]
    path = f"{ROOT / 'examples' / 'regression.py'}:build"
    summary = _fit(path, regression.make_data(n=400), tmp_path / "path", devices="1", steps=5, batch_size=32)
    assert summary["model"] == path and summary["test_accuracy"] is None


def test_evaluate_and_report_of_a_tensors_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from conftest import main_code

    data = regression.make_data(n=400)
    summary = _fit(regression.build, data, tmp_path / "run", devices="1", steps=5, batch_size=32)
    with pytest.raises(UserError, match=r"trained on tensors of yours: pass the test tensors, paratrain.evaluate\(run, "
                                        r"\(inputs, targets\)\)"):
        paratrain.evaluate(tmp_path / "run", model=regression.build)
    again = paratrain.evaluate(tmp_path / "run", data["test"], model=regression.build)  # judged as the run was
    assert again["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-6) and again["test_examples"] == 40
    assert main_code(["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").is_file()


def test_a_sequence_model_over_token_ids_reports_accuracy(tmp_path: Path) -> None:
    summary = _fit(sequences.build, sequences.make_data(), tmp_path / "run", devices="1", **{**SEQUENCES,
                                                                                             "steps": 150})
    assert summary["test_accuracy"] > 0.8  # the commonest class is 0.56 of the test set (it takes the ties); 0.99


# ---- on two workers ----

@pytest.mark.integration
def test_a_regression_on_two_workers_equals_one_device_and_resumes_exactly(tmp_path: Path) -> None:
    data = regression.make_data()
    one = _fit(regression.build, data, tmp_path / "one", devices="1", **REGRESSION)
    two = _fit(regression.build, data, tmp_path / "two", devices="2", **REGRESSION)
    assert two["world_size"] == 2 and two["test_accuracy"] is None
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 5e-6  # measured 4.5e-8
    assert abs(one["test_loss"] - two["test_loss"]) < 1e-5
    # stopped at step 20 and carried on, on 2 workers, with Adam's moments: the uninterrupted run exactly
    _fit(regression.build, data, tmp_path / "half", devices="2", **{**REGRESSION, "steps": 20})
    resumed = _fit(regression.build, data, tmp_path / "half", devices="2",
                   **{**REGRESSION, "resume": str(tmp_path / "half")})
    assert resumed["resumed_from_step"] == 20
    assert max_abs_diff(weights(tmp_path / "half"), weights(tmp_path / "two")) == 0.0


@pytest.mark.integration
def test_a_gru_over_token_ids_on_two_workers_equals_one_device(tmp_path: Path) -> None:
    data = sequences.make_data()
    one = _fit(sequences.build, data, tmp_path / "one", devices="1", **SEQUENCES)
    two = _fit(sequences.build, data, tmp_path / "two", devices="2", **SEQUENCES)
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 4e-5  # measured 3.7e-7
    assert two["test_accuracy"] == one["test_accuracy"]
    # stopped at step 15 (mid-way between checkpoints) and carried on, on 2 workers, with Adam's moments
    _fit(sequences.build, data, tmp_path / "half", devices="2", **{**SEQUENCES, "steps": 15})
    resumed = _fit(sequences.build, data, tmp_path / "half", devices="2",
                   **{**SEQUENCES, "resume": str(tmp_path / "half")})
    assert resumed["resumed_from_step"] == 15
    assert max_abs_diff(weights(tmp_path / "half"), weights(tmp_path / "two")) == 0.0


@pytest.mark.integration
@pytest.mark.parametrize("layout", [{"strategy": "fsdp", "devices": "2"}, {"strategy": "pipeline", "stages": 2},
                                    {"strategy": "hsdp", "devices": "4", "shard_size": 2, "oversubscribe": True}])
def test_the_registry_mlp_on_tensors_shards_and_cuts_into_stages_as_one_device_trains(tmp_path: Path,
                                                                                   layout: dict) -> None:
    data, options = regression.make_data(n=1000), {"steps": 20, "batch_size": 64, "optimizer": "sgd", "lr": 0.01,
                                                   "momentum": 0.9, "width": 32}
    one = _fit("mlp", data, tmp_path / "one", devices="1", **options)
    other = _fit("mlp", data, tmp_path / "other", **options, **layout)
    assert other["strategy"] == layout["strategy"] and other["test_accuracy"] is None
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "other")) < 3e-6  # measured 3.0e-8
    assert abs(one["test_loss"] - other["test_loss"]) < 1e-5


@pytest.mark.integration
@pytest.mark.parametrize("layout", [{"strategy": "pipeline", "stages": 2}, {"strategy": "tower", "devices": "2"},
                                    {"strategy": "fsdp", "devices": "2"}])
def test_the_registry_gru_cuts_into_stages_and_shards_as_one_device_trains(tmp_path: Path, layout: dict) -> None:
    """A pipeline cut before the GRU sends its input's gradient back (a transposed view, made contiguous)."""
    options = {"steps": 20, "batch_size": 60, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "width": 16,
               "depth": 1}
    one = _fit("gru", "tokens", tmp_path / "one", devices="1", **options)
    other = _fit("gru", "tokens", tmp_path / "other", **options, **layout)
    assert other["strategy"] == layout["strategy"]
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "other")) < 6e-6  # measured 6.0e-8 each
    assert other["test_accuracy"] == one["test_accuracy"]


@pytest.mark.integration
def test_a_gru_of_ones_own_under_fsdp_equals_one_device(tmp_path: Path) -> None:
    """Integer inputs, a network of the user's, fsdp's lock-step evaluation (300 test sequences: 150 each)."""
    data = sequences.make_data()
    one = _fit(sequences.build, data, tmp_path / "one", devices="1", **SEQUENCES)
    fsdp = _fit(sequences.build, data, tmp_path / "fsdp", devices="2", strategy="fsdp", **SEQUENCES)
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "fsdp")) < 4e-5  # measured 3.0e-8 (SGD)
    assert fsdp["test_accuracy"] == one["test_accuracy"]


def test_the_worker_named_is_the_one_whose_own_error_ended_the_run(tmp_path: Path) -> None:
    """join() names the first worker it sees fail: after worker 1 died of an error in the network, that may be
    worker 0, whose next all-reduce broke. The one line names worker 1's error; a consequence alone stays."""
    import pickle
    from types import SimpleNamespace

    import torch.multiprocessing as mp

    from paratrain.parallel.launch import _first_cause

    broken = "Traceback ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1\n"
    cause = "Traceback ...\n  File \"net.py\", line 9, in forward\nIndexError: index out of range in self\n"
    files = []
    for rank, trace in enumerate((broken, cause)):
        files.append(str(tmp_path / f"error-{rank}"))
        with open(files[-1], "wb") as f:
            pickle.dump(trace, f)
    context = SimpleNamespace(error_files=files, processes=[SimpleNamespace(pid=100), SimpleNamespace(pid=101)])
    first = mp.ProcessRaisedException(f"\n\n-- Process 0 terminated with the following error:\n{broken}", 0, 100)
    found = _first_cause(context, first)
    assert found.error_index == 1 and "IndexError" in str(found) and found.error_pid == 101
    alone = SimpleNamespace(error_files=[files[0], str(tmp_path / "none")], processes=context.processes)
    assert _first_cause(alone, first) is first  # no other worker said why: the one join() saw


@pytest.mark.integration
def test_a_worker_that_fails_in_the_network_is_named_not_the_one_whose_collective_broke(tmp_path: Path) -> None:
    """A token id past the embedding's vocabulary, far into the data (the check before launch tries two
    examples): the worker that meets it fails with an IndexError, the other in the next all-reduce ("Connection
    closed by peer"). The run's one line names the IndexError, in the user's network, whichever failed first."""
    data = sequences.make_data()
    x, y = data["train"]
    x = x.clone()
    x[700:, 0] = sequences.VOCABULARY  # one past the last token id, from row 700 on: in every late batch
    data["train"] = (x, y)
    with pytest.raises(UserError) as e:
        _fit(sequences.build, data, tmp_path / "run", devices="2", steps=60, batch_size=60, optimizer="adam",
             lr=0.01)
    message = str(e.value)
    assert "IndexError" in message and "Connection closed" not in message, message
    assert "the error is in your code" in message


SCRIPT = """
import sys
sys.path.insert(0, {examples!r})
import paratrain, {task}

if __name__ == "__main__":
    paratrain.fit({task}.build, {task}.make_data(), paratrain.TrainConfig(out={out!r}, devices="2",
                  max_restarts={restarts}, **{options!r}))
"""


@pytest.mark.integration
# 200 steps of the regression: 25 steps of its small MLP took about as long as the kill can lag behind a step
@pytest.mark.parametrize(("task", "settings"), [("regression", {**REGRESSION, "steps": 200}),
                                                ("sequences", {**SEQUENCES, "steps": 60})])
def test_a_killed_worker_restarts_to_the_weights_of_the_untouched_run(tmp_path: Path, task: str,
                                                                      settings: dict) -> None:
    """A regression's MLP and a GRU over token ids, with Adam. The untouched run trains here (the same fit on 2
    workers); the killed one in a script of its own, whose worker is killed."""
    options = {**QUICK, **settings}
    examples = {"regression": regression, "sequences": sequences}[task]
    runs = {"untouched": tmp_path / "untouched", "killed": tmp_path / "killed"}
    _fit(examples.build, examples.make_data(), runs["untouched"], devices="2", **settings)
    script = tmp_path / "killed.py"
    script.write_text(SCRIPT.format(examples=str(ROOT / "examples"), task=task, out=str(runs["killed"]),
                                    restarts=1, options=options))
    code, stderr = kill_a_worker_midway([sys.executable, str(script)], runs["killed"], 15, cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "restarting all workers from the last checkpoint (restart 1 of 1)" in stderr
    summary = json.loads((runs["killed"] / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] >= 10
    assert max_abs_diff(weights(runs["killed"]), weights(runs["untouched"])) == 0.0


class _Rows(torch.utils.data.Dataset):
    """A Dataset of tensors: a row of 6 features and a float target, as a pair or a dict."""

    def __init__(self, n: int = 300, as_dict: bool = False, keys: tuple[str, ...] = ("features", "target")) -> None:
        self.n, self.as_dict, self.keys = n, as_dict, keys

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> object:
        x = torch.randn(6, generator=torch.Generator().manual_seed(i))
        y = x[:3].sum()
        return dict(zip(self.keys, (x, y, y), strict=False)) if self.as_dict else (x, y)


@pytest.mark.parametrize("as_dict", [False, True])
def test_a_dataset_of_tensors_is_read_into_memory_and_split(tmp_path: Path, as_dict: bool) -> None:
    summary = _fit("mlp", _Rows(as_dict=as_dict), tmp_path / "run", devices="1", steps=150, batch_size=32, width=16,
                   lr=0.01, metric="r2")
    assert summary["test_accuracy"] is None and summary["test_r2"] > 0.8  # a linear target


@pytest.mark.parametrize(("dataset", "message"), [
    (_Rows(as_dict=True, keys=("a", "b", "target")), "a dict with keys a, b, target: give two entries, the inputs "
                                                      "and the targets"),
    (_Rows(as_dict=True, keys=("a", "b")), "named one of y, target, targets, label, labels"),
    (_Rows(n=2), "your dataset has 2 item"),
])
def test_a_dataset_of_tensors_that_cannot_train_is_one_line(tmp_path: Path, dataset: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        _fit("mlp", dataset, tmp_path / "run", devices="1", steps=1)


def test_a_dataset_of_tensors_of_unequal_shapes_says_to_pad(tmp_path: Path) -> None:
    items = [(torch.zeros(4), 1.0)] * 5 + [(torch.zeros(3), 1.0)]

    class Ragged(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int) -> tuple:
            return items[i]

    with pytest.raises(UserError, match=r"item 5 of your dataset has inputs of shape \(3,\), item 0 \(4,\); give "
                                        "every item the same shapes"):
        _fit("mlp", Ragged(), tmp_path / "run", devices="1", steps=1)
