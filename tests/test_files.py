"""Data from files on the command line: --dataset tensors (an .npz, a folder of .npy / .pt files) and --dataset
csv --target COLUMN; their splits, their one-line errors; train, eval and search on them."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import main_code, max_abs_diff, run_cli, weights

import paratrain
from paratrain import config as C
from paratrain.core.errors import UserError
from paratrain.data.tables import load_csv, load_tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import regression  # noqa: E402
import sequences  # noqa: E402


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _table(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _regression_csv(path: Path, n: int = 1000) -> Path:
    d = regression.make_data(n=n, features=5)
    x = torch.cat([d[s][0] for s in ("train", "val", "test")])
    y = torch.cat([d[s][1] for s in ("train", "val", "test")])
    return _table(path, [f"f{i}" for i in range(5)] + ["price"],
                  [[f"{v:.6f}" for v in row] + [f"{t:.6f}"] for row, t in zip(x.tolist(), y.tolist(), strict=True)])


# ---- tensors files ----

def test_an_npz_in_keras_names_keeps_its_test_set_and_holds_out_a_validation_set(tmp_path: Path) -> None:
    x, y = np.random.default_rng(0).normal(size=(50, 3)).astype("float32"), np.arange(50) % 3
    path = _npz(tmp_path / "d.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    splits = load_tensors(path, None, None)
    assert splits.kind == "tensors" and splits.num_classes == 3 and splits.input_shape == (3,)
    assert len(splits.val[1]) == 4 and len(splits.train[1]) == 36  # a tenth of the training rows
    assert torch.equal(splits.test[0], torch.from_numpy(x[40:]))
    # every row once; the training rows in the file's order; the same split every time
    rows = torch.cat([splits.train[0], splits.val[0]])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, x[:40].tolist()))
    kept = [i for i in range(40) if x[i].tolist() in splits.train[0].tolist()]
    assert splits.train[0].tolist() == [x[i].tolist() for i in kept]
    assert torch.equal(load_tensors(path, None, None).val[0], splits.val[0])
    assert len(load_tensors(path, 0, None).val[1]) == 0


def test_a_folder_of_npy_and_pt_files_and_one_set_to_split(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    tokens = torch.randint(0, 7, (60, 5))
    np.save(folder / "x.npy", tokens.numpy())
    torch.save(torch.arange(60) % 2, folder / "y.pt")
    splits = load_tensors(folder, 5, 10)
    assert [len(s[1]) for s in (splits.train, splits.val, splits.test)] == [45, 5, 10]
    assert splits.vocabulary == int(tokens.max()) + 1 and splits.train[0].dtype == torch.int64


@pytest.mark.parametrize(("arrays", "message"), [
    ({"x_train": np.zeros((4, 2)), "x_test": np.zeros((2, 2)), "y_test": np.zeros(2)}, "has x_train but no y_train"),
    ({"inputs": np.zeros((4, 2))}, "holds inputs; name the arrays x_train, y_train"),
    ({"x": np.zeros((4, 2)), "y": np.zeros(3)}, "4 training inputs and 3 targets; give one target per input"),
    ({"x_train": np.zeros((8, 2)), "y_train": np.zeros(8), "x_test": np.zeros((2, 3)), "y_test": np.zeros(2)},
     r"the test split inputs are \(3,\) an example, the training inputs \(2,\)"),
    ({"x": np.array([[0.0, 1.0]] * 5 + [[np.nan, 1.0]] * 2), "y": np.zeros(7)},
     r"d.npz, row 5: the inputs hold an empty cell, NaN or inf \(2 rows do\)"),
    ({"x_train": np.zeros((8, 2)), "y_train": np.zeros(8), "x_test": np.zeros((0, 2)), "y_test": np.zeros(0)},
     "the test split holds no rows"),
    ({"x_train": np.array([["a", "b"]] * 4), "y_train": np.zeros(4)}, "x_train holds <U1 values; give numbers"),
])
def test_a_tensors_file_that_cannot_train_is_one_line(tmp_path: Path, arrays: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        load_tensors(_npz(tmp_path / "d.npz", **arrays), None, None)


def test_a_missing_or_unreadable_tensors_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file or folder; give an .npz file"):
        load_tensors(tmp_path / "none.npz", None, None)
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(UserError, match="cannot be read as an .npz file of arrays"):
        load_tensors(tmp_path / "cut.npz", None, None)
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(UserError, match="cannot be read as an .npz file"):  # pickles are not loaded
        load_tensors(tmp_path / "objects.npz", None, None)
    with pytest.raises(UserError, match="the test split holds no rows; give x_test and y_test, or --test-size"):
        load_tensors(_npz(tmp_path / "d.npz", x=np.zeros((9, 2)), y=np.zeros(9)), None, 0)
    with pytest.raises(UserError, match="9 training rows cannot give 9 test rows"):
        load_tensors(tmp_path / "d.npz", None, 9)


def _npy_folder(folder: Path, n: int = 2000, form: str = "splits") -> dict[str, np.ndarray]:
    """The regression's arrays as a folder of .npy files (float64 inputs, as numpy makes them): x_train, ...
    or x and y."""
    folder.mkdir()
    d = regression.make_data(n=n, features=8)
    arrays = {f"{h}_{s}": d[s][i].double().numpy() for s in ("train", "val", "test") for i, h in enumerate("xy")}
    if form == "whole":
        arrays = {h: np.concatenate([arrays[f"{h}_{s}"] for s in ("train", "val", "test")]) for h in "xy"}
    for name, a in arrays.items():
        np.save(folder / f"{name}.npy", a)
    return arrays


def test_inputs_in_npy_files_stay_in_them_and_travel_as_their_paths(tmp_path: Path) -> None:
    """Each worker reads its rows of each batch from the file: a Splits of mapped inputs pickles (to a spawned
    worker) in bytes, not as its data; the rows read are those an .npz of the same arrays holds in memory."""
    import pickle

    from paratrain.data.mapped import MappedTensor

    arrays = _npy_folder(tmp_path / "f", form="whole")
    mapped = load_tensors(tmp_path / "f", None, None)
    assert isinstance(mapped.train[0], MappedTensor) and mapped.train[0].dtype == torch.float32
    assert len(pickle.dumps(mapped.train[0])) < 20_000 < arrays["x"].nbytes  # 128 kB of inputs
    in_memory = load_tensors(_npz(tmp_path / "d.npz", **arrays), None, None)
    for split in ("train", "val", "test"):
        x, y = getattr(mapped, split)
        assert torch.equal(x[: len(x)], getattr(in_memory, split)[0])  # held out by the same permutation
        assert torch.equal(y, getattr(in_memory, split)[1])
    idx = torch.tensor([5, 0, 3])
    assert torch.equal(mapped.train[0][idx], in_memory.train[0][idx])


def test_a_run_on_mapped_inputs_trains_as_on_the_same_inputs_in_memory(tmp_path: Path) -> None:
    arrays = _npy_folder(tmp_path / "f")
    options = dict(devices="1", steps=30, width=16, standardize=True, quiet=True, tensorboard=False)
    paratrain.fit("mlp", tmp_path / "f", paratrain.TrainConfig(dataset="tensors", out=str(tmp_path / "mapped"),
                                                               **options))
    paratrain.fit("mlp", _npz(tmp_path / "d.npz", **arrays), paratrain.TrainConfig(out=str(tmp_path / "memory"),
                                                                                  **options))
    assert max_abs_diff(weights(tmp_path / "mapped"), weights(tmp_path / "memory")) == 0.0


@pytest.mark.parametrize(("array", "message"), [
    (np.array([[0.0, 1.0]] * 3 + [[np.inf, 0.0]]), r"f, row 3: the inputs hold an empty cell, NaN or inf \(1 row "
                                                   r"does\)"),
    (np.array([[True, False]] * 4), "holds bool values; give an array of numbers"),
])
def test_mapped_inputs_are_checked_as_inputs_in_memory_are(tmp_path: Path, array: np.ndarray, message: str) -> None:
    (tmp_path / "f").mkdir()
    np.save(tmp_path / "f" / "x.npy", array)
    np.save(tmp_path / "f" / "y.npy", np.zeros(4))
    with pytest.raises(UserError, match=message):
        load_tensors(tmp_path / "f", 1, 1)


# ---- CSV tables ----

def test_a_table_of_numbers_is_a_regression_and_names_or_whole_numbers_are_classes(tmp_path: Path) -> None:
    splits = load_csv(_regression_csv(tmp_path / "t.csv", 200), "price", None, None)
    assert splits.input_shape == (5,) and splits.target_shape == () and not splits.classification
    assert [len(s[1]) for s in (splits.train, splits.val, splits.test)] == [162, 18, 20]
    rows = [[1.5, 2, "setosa"], [0.5, 1, "virginica"], [1.0, 0, "setosa"], [2.0, 3, "versicolor"]] * 5
    named = load_csv(_table(tmp_path / "iris.csv", ["a", "b", "kind"], rows), "kind", 2, 2)
    assert named.classes == ("setosa", "versicolor", "virginica") and named.num_classes == 3
    numbers = _table(tmp_path / "n.csv", ["a", "b", "c"], [row[:2] + [row[0] * 2] for row in rows])
    counted = load_csv(numbers, "b", 2, 2)  # a few whole numbers: class indices
    assert counted.num_classes == 4 and counted.classes is None
    prices = _table(tmp_path / "p.csv", ["a", "price"], [[i % 7, 250000 + 1000 * i] for i in range(40)])
    priced = load_csv(prices, "price", 2, 2)  # whole numbers of more than 20 values: a regression's
    assert not priced.classification and priced.train[1].dtype == torch.float32
    years = _table(tmp_path / "y.csv", ["a", "year"], [[i, (1990, 2000, 2010)[i % 3]] for i in range(30)])
    assert not load_csv(years, "year", 2, 2).classification  # 3 values, but no class index 2010
    both = load_csv(numbers, "a,b", 2, 2)  # several targets: numbers, a row each
    assert both.target_shape == (2,) and not both.classification


@pytest.mark.parametrize(("header", "rows", "target", "message"), [
    (["a", "price"], [[1, 2]], "prise", r"--target prise: .* has no such column \(did you mean price\?\); its "
                                        "columns: a, price"),
    (["a", "city", "y"], [[1, "Paris", 2.5], [2, "Oslo", 1.0]], "y",
     r"column city is not numbers \(it holds 'Paris'\); paratrain reads numeric features only: encode"),
    (["a", "y"], [[1, 2.5], [2]], "y", r"data row 2: 1 cells, and the header names 2 columns"),
    (["a", "y"], [[1, 2.5], ["", 1.0], [3, 1.5]], "y", r"data row 2: the inputs hold an empty cell, NaN or inf"),
    (["a", "y"], [[1, "inf"], [2, 1.0], [3, 1.5]], "y", r"data row 1: the targets hold an empty cell, NaN or inf"),
    (["a", "y"], [[1, 2.5], ["NA", 1.0], [3, 1.5]], "y", r"data row 2: the inputs hold an empty cell, NaN or inf"),
    (["a", "y"], [[1, 2.5], [2, 1.0]], "Y", r"--target Y: .* has no such column \(did you mean y\?\)"),
    (["a", "y"], [], "y", "holds a header and no rows"),
    (["y"], [[1.0], [2.0]], "y", "every column is a --target"),
])
def test_a_table_that_cannot_train_is_one_line(tmp_path: Path, header: list, rows: list, target: str,
                                              message: str) -> None:
    with pytest.raises(UserError, match=message):
        load_csv(_table(tmp_path / "t.csv", header, rows), target, 0, 1)


@pytest.mark.parametrize(("flags", "message"), [
    ({"dataset": "csv", "data_dir": "t.csv"}, "--dataset csv needs --target COLUMN"),
    ({"dataset": "csv", "target": "y"}, "--dataset csv needs --data-dir FILE.csv"),
    ({"dataset": "tensors"}, "--dataset tensors needs --data-dir PATH, an .npz file or a folder"),
    ({"dataset": "digits", "target": "y"}, "--target names a column of --dataset csv, not of digits"),
    ({"dataset": "mnist", "test_size": 5}, "--test-size is for --dataset imagefolder, tensors, csv, text or jsonl"),
])
def test_what_a_table_or_tensors_file_needs_is_said_before_reading(flags: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        C.validate(C.TrainConfig(**flags))


# ---- train and evaluate ----

def test_a_table_trains_and_evaluates_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    table = _regression_csv(tmp_path / "houses.csv")
    run = tmp_path / "run"
    assert main_code(["train", "--dataset", "csv", "--data-dir", str(table), "--target", "price", "--model", "mlp",
                      "--width", "32", "--steps", "60", "--devices", "1", "--metric", "mae", "--out", str(run),
                      "--no-tensorboard", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] is None and summary["test_mae"] > 0
    capsys.readouterr()
    assert main_code(["eval", str(run), "--data-dir", str(table)]) == 0  # the run's own file: its test rows
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"test_loss {summary['test_loss']:.4f}  test_mae {summary['test_mae']:.4f}  (100 csv "
                           "test examples"), line
    assert main_code(["eval", str(run)]) == 2
    assert "name the file to test on: paratrain eval" in capsys.readouterr().err
    # another file without x_test: every row of it, through the Python API
    other = _table(tmp_path / "other.csv", [f"f{i}" for i in range(5)] + ["price"], [[0.1] * 6, [0.2] * 6])
    assert paratrain.evaluate(run, other)["test_examples"] == 2
    x, y = torch.zeros(3, 5), torch.zeros(3)
    assert paratrain.evaluate(run, (x, y))["test_examples"] == 3
    with pytest.raises(UserError, match=r"trained on inputs of \(5,\) and targets of \(\) an example \(numbers\); "
                                        r"these are \(4,\)"):
        paratrain.evaluate(run, (torch.zeros(3, 4), y))


def test_token_ids_from_an_npz_train_the_registry_gru(tmp_path: Path) -> None:
    d = sequences.make_data(n=1200)
    path = _npz(tmp_path / "tokens.npz", **{f"{h}_{s}": d[s][i].numpy() for s in ("train", "val", "test")
                                            for i, h in enumerate("xy")})
    summary = paratrain.fit("gru", path, paratrain.TrainConfig(out=str(tmp_path / "run"), devices="1", steps=120,
                                                               width=32, depth=1, lr=0.01, quiet=True,
                                                               tensorboard=False))
    assert summary["dataset"] == "tensors" and summary["test_accuracy"] > 0.8  # the majority class: 0.56
    net = paratrain.load_model(tmp_path / "run")  # rebuilt from the checkpoint's vocabulary
    assert net(d["test"][0][:4]).shape == (4, 3)
    with pytest.raises(UserError, match="model 'gru' reads token ids, integers N x L"):
        paratrain.fit("gru", regression.make_data(n=100), paratrain.TrainConfig(out=str(tmp_path / "r"), steps=1))
    with pytest.raises(UserError, match="model 'gru' reads token ids"):
        paratrain.fit("gru", "digits", paratrain.TrainConfig(out=str(tmp_path / "d"), steps=1))


@pytest.mark.integration
def test_two_workers_reading_mapped_inputs_equal_one_device(tmp_path: Path) -> None:
    _npy_folder(tmp_path / "f", n=3000)
    options = dict(dataset="tensors", steps=30, width=16, optimizer="adam", lr=0.003, quiet=True,
                   tensorboard=False, threads_per_worker=1, metric="mae")
    one, two = (paratrain.fit("mlp", tmp_path / "f", paratrain.TrainConfig(out=str(tmp_path / d), devices=d,
                                                                          **options)) for d in ("1", "2"))
    assert max_abs_diff(weights(tmp_path / "1"), weights(tmp_path / "2")) < 5e-6
    assert two["test_mae"] == pytest.approx(one["test_mae"], rel=1e-5)


# ---- search ----

@pytest.mark.integration
def test_a_search_on_a_table_minimises_its_loss_and_on_a_tensors_file_maximises_a_metric(tmp_path: Path) -> None:
    table = _regression_csv(tmp_path / "houses.csv")
    arrays = np.loadtxt(table, delimiter=",", skiprows=1)
    tensors = _npz(tmp_path / "houses.npz", x=arrays[:, :5], y=arrays[:, 5])
    data = {None: f"dataset: csv, data_dir: {table}, target: price", "r2": f"dataset: tensors, data_dir: {tensors}"}
    for objective, key, best_of in ((None, "val_loss", min), ("r2", "val_r2", max)):
        space = tmp_path / f"space-{objective}.yaml"
        space.write_text(f"fixed: {{model: mlp, {data[objective]}, width: 16}}\nparams:\n  lr: [0.0001, 0.01]\n")
        out = tmp_path / (objective or "loss")
        flags = ["--objective", objective, "--metric", objective] if objective else []
        proc = run_cli("search", "--space", str(space), "--sampler", "grid", "--parallel", "2", "--steps", "30",
                       "--out", str(out), *flags, timeout=600)  # a CSV's search, then an .npz's
        assert proc.returncode == 0, proc.stderr[-3000:]
        values = {}
        for folder in (out / "trials").iterdir():
            values[int(folder.name)] = json.loads((folder / "summary.json").read_text())[key]
        chosen = yaml.safe_load((out / "summary.yaml").read_text())
        assert chosen["objective"] == key and chosen["best_trial"] == best_of(values, key=values.get)
        assert chosen["best_value"] == pytest.approx(values[chosen["best_trial"]])
        assert f"search: best validation {key[4:]}" in proc.stdout
        assert len(set(values.values())) == 2  # two different trainings, not one value twice


def test_eval_finds_the_held_out_rows_of_a_copy_and_refuses_a_file_that_grew(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture) -> None:
    """The run's file is known by its path, or by its size and rows (a copy); rows appended since would move the
    held-out ones, so that is refused. Without --model a table trains the registry's mlp."""
    import shutil

    table = _regression_csv(tmp_path / "houses.csv", 400)
    run = tmp_path / "run"
    assert main_code(["train", "--dataset", "csv", "--data-dir", str(table), "--target", "price", "--width", "16",
                      "--steps", "20", "--devices", "1", "--metric", "mae", "--out", str(run), "--no-tensorboard",
                      "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "mlp"
    shutil.copy(table, tmp_path / "copy.csv")
    copied = paratrain.evaluate(run, tmp_path / "copy.csv", metrics={"bias": lambda o, t: (o - t).mean()})
    assert copied["rows"] == "the test rows the run held out" and copied["test_examples"] == 40
    assert copied["test_mae"] == pytest.approx(summary["test_mae"], rel=1e-6) and "test_bias" in copied
    assert copied["test_accuracy"] is None  # as summary.json has it
    with open(tmp_path / "copy.csv", "a") as f:
        f.write(",".join(["0.5"] * 6) + "\n")
    assert main_code(["eval", str(run), "--data-dir", str(table)]) == 0  # the run's own path: its rows
    with open(table, "a") as f:
        f.write(",".join(["0.5"] * 6) + "\n")
    capsys.readouterr()
    assert main_code(["eval", str(run), "--data-dir", str(table)]) == 2
    assert "holds 401 rows, and the run held its test rows out of 400" in capsys.readouterr().err
    other = paratrain.evaluate(run, tmp_path / "copy.csv")  # another file (its size differs): every row
    assert other["rows"] == "every row" and other["test_examples"] == 401
    lines = (tmp_path / "houses.csv").read_text().splitlines()[:401]  # the run's rows, in another order
    (tmp_path / "shuffled.csv").write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    assert paratrain.evaluate(run, tmp_path / "shuffled.csv")["rows"] == "every row"
    test = (torch.zeros(3, 5), torch.zeros(3))
    assert paratrain.evaluate(run, {"test": test})["test_examples"] == 3


def test_whole_numbers_are_numbers_to_a_loss_that_compares_numbers(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    rows = [[i % 5, (i * 7) % 3] for i in range(60)]  # a target of 3 whole numbers: class indices by default
    table = _table(tmp_path / "t.csv", ["a", "y"], rows)
    base = ["train", "--dataset", "csv", "--data-dir", str(table), "--target", "y", "--steps", "3", "--devices", "1",
            "--no-tensorboard", "--batch-size", "16"]
    assert main_code([*base, "--out", str(tmp_path / "c")]) == 0
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["test_accuracy"] is not None
    assert main_code([*base, "--loss", "mse", "--out", str(tmp_path / "r")]) == 0
    assert "--loss mse takes the targets as numbers (a regression)" in capsys.readouterr().err
    regression_run = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert regression_run["test_accuracy"] is None
    named = _table(tmp_path / "n.csv", ["a", "kind"], [[i, ("high", "low", "mid")[i % 3]] for i in range(60)])
    assert main_code([*base[:4], str(named), "--target", "kind", *base[7:], "--loss", "mse", "--out",
                      str(tmp_path / "n")]) == 2
    assert "--loss mse compares numbers, and these targets are classes by name (high, low, mid)" in \
        capsys.readouterr().err
    assert paratrain.evaluate(tmp_path / "r", table)["rows"] == "the test rows the run held out"
