"""Your own network and your own images (issue 19): models by import path, image folders decoded once into a
memory-mapped cache, and the bad input of both as one line."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import main_code, max_abs_diff, run_cli, train_here, weights
from PIL import Image

import paratrain
import paratrain.data
from paratrain import UserError
from paratrain.core.import_path import absolute, is_import_path
from paratrain.data import dataset, decode, folder
from paratrain.data.source import MappedImages
from paratrain.models.imported import call_factory, resolve

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "residual_cnn.py"
sys.path.insert(0, str(ROOT / "examples"))
import make_shapes  # noqa: E402

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


_main = main_code


def _one_line(capsys: pytest.CaptureFixture, code: int, expected: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and expected in err[0], err


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 PNGs of 3 shapes (20 a class), their cache built by the first test that loads them."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes.write(root, per_class=20)
    return root


# ---- models by import path ----

def test_an_import_path_is_a_model_name() -> None:
    assert is_import_path("examples/net.py:build") and is_import_path("my_pkg.nets:Net")
    assert not is_import_path("lenet5") and not is_import_path("C:net") and not is_import_path("a.py:")
    assert absolute("examples/net.py:build") == f"{Path('examples/net.py').resolve()}:build"
    assert absolute("my_pkg.nets:Net") == "my_pkg.nets:Net"  # a module path is looked up, not a file


def test_a_run_of_an_imported_model_is_named_after_its_factory() -> None:
    from paratrain import config

    for model, name in ((f"{EXAMPLE}:build", "runs/residual_cnn.build-digits-"), ("my_pkg.nets:Net", "runs/nets.Net-")):
        out = config.with_run_dir(paratrain.TrainConfig(model=model)).out
        assert out.startswith(name) and out.count("/") == 1, out


def test_a_factory_gets_the_shapes_it_names() -> None:
    seen = {}

    def only_classes(num_classes):  # noqa: ANN001, ANN202
        seen["a"] = num_classes

    def every(**kw):  # noqa: ANN003, ANN202
        seen["b"] = kw

    def named_and_more(channels, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["d"] = (channels, kw)

    call_factory(only_classes, 3, 32, 7)
    call_factory(every, 3, 32, 7)  # as torchvision's resnet18(**kwargs): only num_classes reaches the network
    call_factory(named_and_more, 3, 32, 7)
    call_factory(lambda: seen.setdefault("c", 1), 3, 32, 7)
    assert seen == {"a": 7, "b": {"num_classes": 7}, "c": 1, "d": (3, {})}
    import torchvision

    assert call_factory(torchvision.models.resnet18, 3, 32, 7).fc.out_features == 7


def test_resolve_by_file_and_by_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve(f"{EXAMPLE}:build").__name__ == "build"
    (tmp_path / "my_nets.py").write_text("def net():\n    return 1\n")
    monkeypatch.chdir(tmp_path)  # a package of the user's is looked for in the current folder, as python -m does
    assert resolve("my_nets:net")() == 1


@pytest.mark.parametrize(("model", "expected"), [
    ("nowhere/net.py:build", "does not exist"),
    ("no_such_package.nets:build", "no module named 'no_such_package'"),
    (f"{EXAMPLE}:biuld", "has no 'biuld'; it defines: Residual, build"),
    (f"{EXAMPLE}:Residual", "the factory failed: TypeError"),  # it needs cin and cout
    ("{raises}:build", "importing"),
    ("{wrong}:build", "it must return N x K logits"),
    ("{not_module}:build", "returned a int, not an nn.Module"),
])
def test_a_bad_import_path_is_one_line(model: str, expected: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    files = {"raises": "raise RuntimeError('no GPU here')\n",
             "wrong": "import torch\ndef build():\n    return torch.nn.Flatten(0)\n",
             "not_module": "def build():\n    return 3\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    model = model.format(**{name: tmp_path / f"{name}.py" for name in files})
    code = _main(["train", "--model", model, "--steps", "1", "--out", str(tmp_path / "run"), "--quiet"])
    _one_line(capsys, code, expected)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_an_imported_model_trains_resumes_and_evaluates_by_its_name(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    args = ["train", "--model", "examples/residual_cnn.py:build", "--steps", "4", "--checkpoint-every", "2",
            "--optimizer", "sgd", "--lr", "0.05", "--out", str(run), "--quiet", "--no-tensorboard", "--devices", "1"]
    assert _main(args) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"] == f"{EXAMPLE}:build"  # absolute: --resume works from any folder
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == f"{EXAMPLE}:build" and summary["parts"] is None  # not "custom"
    monkeypatch.chdir(tmp_path)
    assert _main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    result = paratrain.evaluate(run)
    assert result["model"] == f"{EXAMPLE}:build" and result["test_accuracy"] == pytest.approx(
        json.loads((run / "summary.json").read_text())["test_accuracy"])
    assert paratrain.evaluate(run)["test_examples"] == 359
    net = paratrain.load_model(run)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 9  # 1 + 2 + 3 + 3


# ---- the memory-mapped source ----

def test_mapped_rows_come_back_in_the_order_asked_and_pickle_as_a_path(tmp_path: Path) -> None:
    data = np.arange(10 * 1 * 2 * 2, dtype=np.uint8).reshape(10, 1, 2, 2)
    np.save(tmp_path / "x.npy", data)
    images = MappedImages(str(tmp_path / "x.npy")).subset(np.array([9, 7, 5, 3, 1]))
    assert images.shape == (5, 1, 2, 2) and len(images) == 5
    assert torch.equal(images[torch.tensor([2, 0, 4])], torch.from_numpy(data[[5, 9, 1]]))
    assert torch.equal(images[1:3], torch.from_numpy(data[[7, 5]]))
    blob = pickle.dumps(images)
    assert len(blob) < 1000  # the path and the row numbers, not the pixels
    assert torch.equal(pickle.loads(blob)[torch.tensor([1])], torch.from_numpy(data[[7]]))


# ---- image folders ----

def test_a_folder_is_decoded_once_then_opened_from_its_cache(shapes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = folder.load(str(shapes), quiet=True, workers=1)
    assert first.classes == ("circle", "square", "triangle") and first.num_classes == 3
    sides = sorted(min(Image.open(p).size) for p in shapes.rglob("*.png"))
    assert first.channels == 3 and first.image_size == sides[len(sides) // 2]  # the median shorter side
    n = sum(len(p[1]) for p in (first.train, first.val, first.test))
    assert n == 60 and len(first.test[1]) == 6 and len(first.val[1]) == 6  # a tenth each
    assert isinstance(first.train[0], MappedImages)
    monkeypatch.setattr(folder, "build_cache", lambda *a, **k: pytest.fail("decoded again"))
    again = folder.load(str(shapes), quiet=True)
    assert torch.equal(again.train[0][:], first.train[0][:]) and torch.equal(again.test[1], first.test[1])
    assert again.mean == first.mean and again.std == first.std
    # the statistics are those of the training images, as a float copy of them would give
    x = first.train[0][:].double() / 255
    assert np.allclose(first.mean, x.mean(dim=(0, 2, 3)).tolist(), atol=1e-12)
    assert np.allclose(first.std, x.std(dim=(0, 2, 3)).tolist(), atol=1e-9)


def test_a_changed_file_rebuilds_the_cache_and_a_failed_build_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_shapes.write(tmp_path / "d", per_class=4)
    before = folder.load(str(tmp_path / "d"), quiet=True, workers=1)
    cache = Path(before.train[0].path).parent
    decoded = np.load(cache / "images.npy")
    image = tmp_path / "d" / "circle" / "circle-0000.png"
    make_shapes.draw("square", __import__("random").Random(5)).save(image)  # changed content, size and mtime
    os.utime(image, ns=(1, 1))

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt  # Ctrl-C in the middle of decoding

    good = {f: (cache / f).read_bytes() for f in ("manifest.json", "images.npy", "labels.npy", "sums.npy")}
    monkeypatch.setattr("paratrain.data.decode.decode_many", broken)  # what decode_into maps over the images
    with pytest.raises(KeyboardInterrupt):
        folder.load(str(tmp_path / "d"), quiet=True, workers=1)
    assert {f: (cache / f).read_bytes() for f in good} == good  # the good cache is as it was
    assert not [p for p in cache.parent.iterdir() if "building" in p.name]  # no half-built folder left
    monkeypatch.undo()
    after = folder.load(str(tmp_path / "d"), quiet=True, workers=1)
    assert Path(after.train[0].path).parent == cache
    assert len(after.train[1]) == len(before.train[1])
    changed = np.load(cache / "images.npy")
    assert decoded.shape == changed.shape and (decoded != changed).any(axis=(1, 2, 3)).sum() == 1  # decoded again


@pytest.mark.parametrize("size", [(61, 40), (40, 61), (50, 50)])
def test_images_are_resized_and_cropped_as_torchvision_does(size: tuple[int, int], tmp_path: Path) -> None:
    from torchvision.transforms import functional as TF

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    image.save(tmp_path / "x.png")
    expected = np.asarray(TF.center_crop(TF.resize(image, 32), 32)).transpose(2, 0, 1)
    assert np.array_equal(decode.decode_image(str(tmp_path / "x.png"), 32, 3), expected)


@pytest.mark.parametrize(("make", "expected"), [
    (lambda d: None, "has no class folders"),
    (lambda d: make_shapes.write(d, 2) and [p.unlink() for p in (d / "square").iterdir()], "has no images"),
    (lambda d: (d / "only").mkdir(), "has only the class folder 'only'"),
    (lambda d: make_shapes.write(d, 2) and (d / "circle" / "bad.png").write_bytes(b"not a png"),
     "circle/bad.png is not a readable image"),
    (lambda d: make_shapes.write(d, 2) and (d / "circle" / "short.png").write_bytes(
        (d / "circle" / "circle-0000.png").read_bytes()[:80]), "circle/short.png is not a readable image"),
])
def test_a_bad_folder_is_one_line(make, expected: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    data = tmp_path / "d"
    data.mkdir()
    make(data)
    code = _main(["train", "--dataset", "imagefolder", "--data-dir", str(data), "--steps", "1", "--quiet",
                  "--out", str(tmp_path / "run")])
    _one_line(capsys, code, expected)


def test_bad_images_are_skipped_and_counted_when_asked(tmp_path: Path) -> None:
    data = tmp_path / "d"
    make_shapes.write(data, 4)
    (data / "circle" / "bad.png").write_bytes(b"not a png")
    (data / "circle" / "notes.txt").write_text("not an image, and not taken for one")
    splits = folder.load(str(data), skip_bad=True, quiet=True, workers=1)
    assert sum(len(p[1]) for p in (splits.train, splits.val, splits.test)) == 12
    manifest = json.loads((Path(splits.train[0].path).parent / "manifest.json").read_text())
    assert list(manifest["skipped"]) == ["circle/bad.png"]
    with pytest.raises(UserError, match="circle/bad.png is not a readable image"):  # the same cache, no flag
        folder.load(str(data), quiet=True, workers=1)


def test_train_val_test_folders_are_the_splits(tmp_path: Path) -> None:
    for split, n in (("train", 5), ("test", 2)):
        make_shapes.write(tmp_path / "d" / split, n, seed=n)
    (tmp_path / "d" / "train" / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    splits = folder.load(str(tmp_path / "d"), val_size=3, quiet=True, workers=1)
    assert (len(splits.train[1]), len(splits.val[1]), len(splits.test[1])) == (12, 3, 6)
    assert splits.test[1].tolist() == [0, 0, 1, 1, 2, 2]
    # train/ alone: validation and test images are both held out of it, never an empty test set
    make_shapes.write(tmp_path / "e" / "train", 10)
    alone = folder.load(str(tmp_path / "e"), test_size=4, quiet=True, workers=1)
    assert (len(alone.train[1]), len(alone.val[1]), len(alone.test[1])) == (23, 3, 4)
    rows = [set(p[0].rows.tolist()) for p in (alone.train, alone.val, alone.test)]
    assert not (rows[0] & rows[1] or rows[0] & rows[2] or rows[1] & rows[2])  # disjoint


def test_two_builds_at_once_decode_once_and_a_replaced_cache_is_refused(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    make_shapes.write(tmp_path / "d", 4)
    builds = []
    real = folder.build_cache
    monkeypatch.setattr(folder, "build_cache", lambda *a, **k: builds.append(1) or real(*a, **k))
    results = []
    threads = [threading.Thread(target=lambda: results.append(folder.load(str(tmp_path / "d"), quiet=True,
                                                                          workers=1))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and len(builds) == 1  # the second waited for the first, then opened its cache
    old = pickle.loads(pickle.dumps(results[0].train[0]))  # as a worker would receive it
    make_shapes.write(tmp_path / "d", 5)  # a new image: the next load rebuilds the cache
    folder.load(str(tmp_path / "d"), quiet=True, workers=1)
    with pytest.raises(UserError, match="was replaced while this run used it"):
        pickle.loads(pickle.dumps(results[0].train[0]))[0:1]
    assert old is not None


def test_folder_flags_need_a_folder(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    _one_line(capsys, _main(["train", "--dataset", "imagefolder", "--steps", "1"]), "needs --data-dir DIR")
    _one_line(capsys, _main(["train", "--image-size", "32", "--steps", "1"]),
              "--image-size is for --dataset imagefolder, not digits")
    _one_line(capsys, _main(["train", "--data-dir", str(tmp_path), "--steps", "1"]),  # not silently the digits
              "--data-dir is not read by --dataset digits; for a folder with a sub-folder of images per class, "
              "pass --dataset imagefolder")
    from paratrain import config

    saved = config.validate(paratrain.TrainConfig(dataset="mnist", data_dir="some/where")).data_dir
    assert saved == str(Path("some/where").resolve())  # --resume from another folder reads the same files


def test_the_memory_map_trains_as_the_same_images_in_memory(shapes: Path, tmp_path: Path) -> None:
    """Same seed, same steps: training from the cache file equals training from a copy of it in memory."""
    mapped = folder.load(str(shapes), quiet=True)
    in_memory = dataclasses.replace(mapped, **{s: (getattr(mapped, s)[0][:], getattr(mapped, s)[1])
                                               for s in ("train", "val", "test")})
    assert isinstance(in_memory.train[0], torch.Tensor)
    cfg = dict(model=f"{EXAMPLE}:build", steps=6, batch_size=12, optimizer="sgd", lr=0.05, **QUICK)
    a = paratrain.fit(None, mapped, paratrain.TrainConfig(out=str(tmp_path / "a"), **cfg))
    b = paratrain.fit(None, in_memory, paratrain.TrainConfig(out=str(tmp_path / "b"), **cfg))
    assert max_abs_diff(weights(tmp_path / "a"), weights(tmp_path / "b")) == 0.0
    assert a["test_accuracy"] == b["test_accuracy"]
    caches = sorted(p.name for p in folder.user_cache().joinpath("folders").iterdir() if not p.name.startswith("."))
    # the folder given to evaluate is scored whole (the run was given Splits: it does not know the folder),
    # from the cache training read
    every = sum(len(getattr(mapped, s)[1]) for s in ("train", "val", "test"))
    assert paratrain.evaluate(tmp_path / "a", shapes)["test_examples"] == every
    assert sorted(p.name for p in folder.user_cache().joinpath("folders").iterdir()
                  if not p.name.startswith(".")) == caches
    assert sorted(p.name for p in shapes.iterdir()) == sorted(make_shapes.CLASSES)  # nothing of ours in the folder


# ---- the whole path, on 2 workers ----

@pytest.mark.integration
def test_the_example_on_two_workers_equals_one_and_resumes_exactly(shapes: Path, tmp_path: Path) -> None:
    args = ("--model", str(EXAMPLE) + ":build", "--dataset", "imagefolder", "--data-dir", str(shapes),
            "--steps", "20", "--batch-size", "24", "--optimizer", "sgd", "--lr", "0.0003", "--momentum", "0.9",
            "--batchnorm", "sync")  # momentum: a resume must carry the optimizer's state on 2 workers
    one = train_here(tmp_path / "one", *args, "--devices", "1")
    two = train_here(tmp_path / "two", *args, "--devices", "2")
    assert two["world_size"] == 2 and one["dataset"] == "imagefolder"
    # measured 6.7e-6. This residual BatchNorm network amplifies float noise: one worker on 1 thread against
    # 2 threads differs by 1.9e-6 here; 1 against 2 workers by 1.0e-4 at lr 0.001 with momentum 0.9 and 3.1e-5
    # at lr 0.001 with momentum 0.5 (hence lr 0.0003, far from that edge)
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 5e-4
    assert two["test_accuracy"] == one["test_accuracy"]
    # stopped at 10 and resumed on 2 workers: the same weights as the uninterrupted run
    train_here(tmp_path / "half", *args, "--devices", "2", "--steps", "10")
    resumed = run_cli("train", "--resume", str(tmp_path / "half"), "--steps", "20", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert max_abs_diff(weights(tmp_path / "half"), weights(tmp_path / "two")) == 0.0
    assert "decoded" not in resumed.stderr  # the cache was opened, not rebuilt


# ---- the sets published in MNIST's and CIFAR's formats ----

def _idx(dims: list[int]) -> bytes:
    header = bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    return header + bytes(i % 10 for i in range(int(np.prod(dims))))


@pytest.mark.parametrize(("dataset", "raw"), [("fashion-mnist", "FashionMNIST"), ("kmnist", "KMNIST")])
def test_the_mnist_format_sets_read_their_files(dataset: str, raw: str, tmp_path: Path) -> None:
    folder = tmp_path / raw / "raw"  # where torchvision's download puts them
    folder.mkdir(parents=True)
    for name, dims in (("train-images-idx3-ubyte", [30, 28, 28]), ("train-labels-idx1-ubyte", [30]),
                       ("t10k-images-idx3-ubyte", [10, 28, 28]), ("t10k-labels-idx1-ubyte", [10])):
        (folder / name).write_bytes(_idx(dims))
    splits = paratrain.data.load_dataset(dataset, str(tmp_path), download=False, val_size=5)
    assert (len(splits.train[1]), len(splits.val[1]), len(splits.test[1])) == (25, 5, 10)
    assert splits.name == dataset and splits.mean != (0.1307,)  # its own statistics, not MNIST's
    with pytest.raises(UserError, match=f"{'Fashion-MNIST' if raw == 'FashionMNIST' else 'KMNIST'} file"):
        paratrain.data.load_dataset(dataset, str(tmp_path / "empty"), download=False)


def _cifar100_records(n: int) -> bytes:
    return b"".join(bytes([i % 20, (i * 7) % 100]) + bytes([i % 256]) * 3072 for i in range(n))


def test_cifar100_binary_and_python_with_fine_or_coarse_labels(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    binary = tmp_path / "bin" / "cifar-100-binary"
    binary.mkdir(parents=True)
    (binary / "train.bin").write_bytes(_cifar100_records(30))
    (binary / "test.bin").write_bytes(_cifar100_records(10))
    fine = paratrain.data.load_dataset("cifar100", str(tmp_path / "bin"), download=False, val_size=5)
    coarse = paratrain.data.load_dataset("cifar100", str(tmp_path / "bin"), download=False, val_size=5,
                                         labels="coarse")
    assert fine.num_classes == 100 and coarse.num_classes == 20
    assert fine.test[1].tolist() == [(i * 7) % 100 for i in range(10)] and coarse.test[1].tolist() == list(range(10))
    assert torch.equal(fine.test[0][3], torch.full((3, 32, 32), 3, dtype=torch.uint8))
    python = tmp_path / "py" / "cifar-100-python"
    python.mkdir(parents=True)
    for name, n in (("train", 30), ("test", 10)):
        records = np.frombuffer(_cifar100_records(n), dtype=np.uint8).reshape(n, -1)
        with open(python / name, "wb") as f:
            pickle.dump({"data": records[:, 2:].copy(), "fine_labels": records[:, 1].tolist(),
                         "coarse_labels": records[:, 0].tolist()}, f)
    again = paratrain.data.load_dataset("cifar100", str(tmp_path / "py"), download=False, val_size=5,
                                        labels="coarse")
    assert torch.equal(again.test[1], coarse.test[1]) and torch.equal(again.train[0], coarse.train[0])
    (binary / "test.bin").write_bytes(_cifar100_records(10)[:-5])
    code = _main(["train", "--dataset", "cifar100", "--data-dir", str(tmp_path / "bin"), "--no-download",
                  "--steps", "1", "--out", str(tmp_path / "run")])
    _one_line(capsys, code, "not a whole number of 3074-byte CIFAR-100 records")
    _one_line(capsys, _main(["train", "--labels", "coarse", "--steps", "1"]), "--labels is for --dataset cifar100")


class Shapes(torch.utils.data.Dataset):
    """A map-style Dataset of (PIL image, label) pairs of several sizes, as torchvision's datasets give."""

    classes = ["circle", "square", "triangle"]

    def __init__(self, n: int) -> None:
        import random

        rng = random.Random(1)
        self.items = [(make_shapes.draw(self.classes[i % 3], rng), i % 3) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):  # noqa: ANN204
        return self.items[i]


def test_a_dataset_is_decoded_once_into_the_run_and_reopened_on_resume(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    cfg = dict(model=f"{EXAMPLE}:build", batch_size=8, optimizer="sgd", lr=0.01, image_size=32, **QUICK)
    summary = paratrain.fit(None, Shapes(60), paratrain.TrainConfig(steps=3, out=str(run), **cfg))
    assert summary["classes"] == Shapes.classes and summary["dataset"] == "custom"
    assert np.load(run / "data-cache" / "images.npy", mmap_mode="r").shape == (60, 3, 32, 32)
    monkeypatch.setattr(dataset, "_build_from_dataset", lambda *a, **k: pytest.fail("decoded again"))
    again = paratrain.fit(None, Shapes(60), paratrain.TrainConfig(resume=str(run), steps=5, quiet=True))
    assert again["steps"] == 5 and again["resumed_from_step"] == 3
    classifier = paratrain.load_classifier(run)
    assert classifier.classes == Shapes.classes
    monkeypatch.undo()
    result = paratrain.evaluate(run, Shapes(60))  # decoded apart, not into the run; every item scored
    assert result["test_examples"] == 60
    own = paratrain.evaluate(run)  # the run's own held-out test split, from its decoded copy
    assert own["test_accuracy"] == again["test_accuracy"] and own["test_examples"] == 6
    shutil.rmtree(run / "data-cache")
    with pytest.raises(UserError, match="its decoded copy .* is gone; pass the test data: paratrain.evaluate"):
        paratrain.evaluate(run)
    bad = torch.utils.data.StackDataset(["not an image"] * 5, [0] * 5)
    with pytest.raises(UserError, match="item 0 of your dataset is not an .image, label. pair paratrain can read"):
        paratrain.fit(None, bad, paratrain.TrainConfig(steps=1, out=str(tmp_path / "r2"), **QUICK))
    for item, why in (((torch.zeros(3, 8, 8), 0.5), "the label 0.5 is not a class index"),
                      ((torch.full((3, 8, 8), 2.0), 1), "a float image must hold pixels in 0..1")):
        with pytest.raises(UserError, match=why):
            paratrain.fit(None, torch.utils.data.StackDataset(*zip(*[item] * 5, strict=True)),
                          paratrain.TrainConfig(steps=1, out=str(tmp_path / "r3"), **QUICK))
    with pytest.raises(UserError, match="a torch Dataset of .image, label. pairs, a Splits, .* not a list"):
        paratrain.fit(None, [("not an image", 0)] * 5, paratrain.TrainConfig(steps=1, out=str(tmp_path / "r2"),
                                                                             **QUICK))


def test_a_dataset_cache_named_by_a_key_is_shared_by_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dict(model=f"{EXAMPLE}:build", batch_size=8, optimizer="sgd", lr=0.01, image_size=32,
               cache_dir=str(tmp_path / "caches"), **QUICK)
    paratrain.fit(None, Shapes(30), paratrain.TrainConfig(steps=1, out=str(tmp_path / "a"), **cfg), cache_key="shapes")
    assert (tmp_path / "caches" / "datasets" / "shapes" / "32" / "images.npy").is_file()  # a folder per size
    assert not (tmp_path / "a" / "data-cache").exists()
    monkeypatch.setattr(dataset, "_build_from_dataset", lambda *a, **k: pytest.fail("decoded again"))
    second = paratrain.fit(None, Shapes(30), paratrain.TrainConfig(steps=1, out=str(tmp_path / "b"), **cfg),
                           cache_key="shapes")  # a new run, not a resumed one: it opens the named cache
    assert second["steps"] == 1
    monkeypatch.undo()
    with pytest.raises(UserError, match="cache_key '../x' must be a plain name"):
        paratrain.fit(None, Shapes(30), paratrain.TrainConfig(steps=1, out=str(tmp_path / "c"), **cfg),
                      cache_key="../x")
    with pytest.raises(UserError, match="cache_key names the cache of a torch Dataset"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=1, out=str(tmp_path / "d"), **QUICK),
                      cache_key="digits")
    with pytest.raises(UserError, match="your dataset has 2 item.s.; it needs at least one each to train"):
        paratrain.fit(None, Shapes(2), paratrain.TrainConfig(steps=1, out=str(tmp_path / "e"), **QUICK))


def test_a_held_out_split_keeps_its_images_when_one_is_added(tmp_path: Path) -> None:
    make_shapes.write(tmp_path / "d", 12)

    def test_images() -> set[bytes]:
        splits = folder.load(str(tmp_path / "d"), image_size=24, val_size=6, test_size=6, quiet=True, workers=1)
        return {np.asarray(splits.test[0][i:i + 1]).tobytes() for i in range(len(splits.test[1]))}

    before = test_images()
    files = sorted(str(p.relative_to(tmp_path / "d")) for p in (tmp_path / "d").rglob("*.png"))
    Image.new("RGB", (16, 16), (9, 9, 9)).save(tmp_path / "d" / Path(files[0]).parent / "added.png")
    after = test_images()
    assert len(before) == 6 and len(before & after) >= 5  # at most one image of six moved


def test_a_build_in_progress_is_waited_for_aloud(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import threading

    target = tmp_path / "cache"
    waited = threading.Event()

    def second() -> None:
        with folder.locked(target, quiet=False):
            waited.set()

    with folder.locked(target):
        t = threading.Thread(target=second)
        t.start()
        t.join(1.5)  # past the second after which a wait is said aloud
        assert not waited.is_set()  # blocked behind the build
    t.join(5.0)
    assert waited.is_set()
    assert f"waiting for another process that builds the image cache {target}" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "expected"), [
    (["--image-size", "0"], "--image-size must be"),
    (["--test-size", "-1"], "--test-size must not be negative"),
])
def test_bad_folder_numbers_are_one_line(args: list[str], expected: str, shapes: Path, capsys) -> None:  # noqa: ANN001
    _one_line(capsys, _main(["train", "--dataset", "imagefolder", "--data-dir", str(shapes), "--steps", "1",
                             "--quiet", *args]), expected)


def test_an_unwritable_cache_dir_is_one_line(shapes: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    blocked = tmp_path / "a-file"  # a folder cannot be made under a file, whoever runs the test (root too)
    blocked.write_text("")
    _one_line(capsys, _main(["train", "--dataset", "imagefolder", "--data-dir", str(shapes), "--cache-dir",
                             str(blocked / "c"), "--steps", "1", "--quiet", "--out", str(tmp_path / "r")]),
              "cannot write the image cache in")


def test_kmnist_asked_of_mnist_files_is_refused(tmp_path: Path) -> None:
    """The three IDX sets share file names; a full training file with MNIST's mean pixel is MNIST."""
    from paratrain.data import mnist

    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in (60_000, 28, 28))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(header + bytes([33]) * (60_000 * 784))  # mean 0.129
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx([60_000]))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx([10, 28, 28]))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx([10]))
    with pytest.raises(UserError, match="hold MNIST, not KMNIST .* pass --dataset mnist"):
        mnist.load(str(tmp_path), False, None, "kmnist")
    assert mnist.load(str(tmp_path), False, None, "mnist").name == "mnist"


def test_a_network_with_more_scores_than_classes_gets_a_note(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    cfg = paratrain.TrainConfig(steps=1, out=str(tmp_path / "r"), tensorboard=False, devices="1")
    paratrain.fit(lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(12)), "digits", cfg)
    assert "your network gives 12 scores per image and the data has 10 classes" in capsys.readouterr().out


def test_python_callers_read_field_names_not_flags(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="^devices must be 'auto' or a positive number, not '0'$"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(devices=0, out=str(tmp_path / "r")))
    with pytest.raises(UserError, match="^image_size is for dataset imagefolder, not digits$"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(image_size=32, out=str(tmp_path / "r")))


def test_what_a_new_user_tried(shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    # a TensorDataset's labels are 0-d tensors: class indices like any other
    x = torch.rand(12, 3, 8, 8)
    pairs = torch.utils.data.TensorDataset(x, torch.arange(12) % 3)
    assert dataset._item(pairs, 4)[1] == 1
    one_class = torch.utils.data.TensorDataset(x, torch.zeros(12, dtype=torch.long))
    with pytest.raises(UserError, match="every item of your dataset has the label 0; a classifier needs at least two"):
        paratrain.fit(None, one_class, paratrain.TrainConfig(steps=1, out=str(tmp_path / "one"), **QUICK))
    # model= takes an import path too, as config.model does
    summary = paratrain.fit(f"{EXAMPLE}:build", "digits", paratrain.TrainConfig(steps=1, out=str(tmp_path / "r"),
                                                                                 **QUICK))
    assert summary["model"] == f"{EXAMPLE}:build"
    # a typo in the factory's name is found before a new folder is decoded
    make_shapes.write(tmp_path / "fresh", 3)
    monkeypatch.setattr(folder, "build_cache", lambda *a, **k: pytest.fail("decoded before the model was found"))
    _one_line(capsys, _main(["train", "--model", f"{EXAMPLE}:biuld", "--dataset", "imagefolder", "--data-dir",
                             str(tmp_path / "fresh"), "--steps", "1"]), "has no 'biuld'; it defines: ")
    monkeypatch.undo()
    # paratrain eval RUN, and a folder run's test folder named in the line that asks for it
    assert _main(["train", "--model", f"{EXAMPLE}:build", "--dataset", "imagefolder", "--data-dir", str(shapes),
                  "--steps", "2", "--devices", "1", "--batch-size", "16", "--quiet", "--no-tensorboard", "--out",
                  str(tmp_path / "f")]) == 0
    capsys.readouterr()
    _one_line(capsys, _main(["eval", str(tmp_path / "f")]),
              f"name the image folder to test on: paratrain eval {tmp_path / 'f'} --data-dir DIR (Python: "
              f"evaluate(run, DIR)); the run trained on {shapes}")
    assert _main(["eval", str(tmp_path / "f"), "--data-dir", str(shapes)]) == 0
    assert "test_accuracy" in capsys.readouterr().out


def test_a_dataset_cache_is_its_own_datasets_and_of_its_size(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    first = dataset.from_dataset(Shapes(30), tmp_path / "c", 16, None, None, reuse=True, quiet=True)
    first_image = first.test[0][0:1]  # read now: the next call rebuilds the cache under it
    other = torch.utils.data.TensorDataset(torch.rand(30, 3, 16, 16), torch.arange(30) % 3)  # same length
    second = dataset.from_dataset(other, tmp_path / "c", 16, None, None, reuse=True, quiet=True)
    assert first.split == second.split == "index-hash"
    assert not torch.equal(first_image, second.test[0][0:1])  # rebuilt: not the first Dataset's images
    assert folder.dataset_cache("k", str(tmp_path), 32) != folder.dataset_cache("k", str(tmp_path), 64)
    with pytest.raises(UserError, match="cache_key 'a b' must be a plain name"):
        folder.dataset_cache("a b", None, None)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(UserError, match="cannot write the dataset's cache in .*a-file.*; set cache_dir"):
        paratrain.fit(None, Shapes(30), paratrain.TrainConfig(steps=1, out=str(tmp_path / "r"), image_size=16,
                                                              cache_dir=str(blocked), **QUICK), cache_key="k")


def test_a_folder_run_of_the_earlier_split_is_not_resumed(shapes: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from paratrain.checkpoint import files as checkpoint

    run = tmp_path / "r"
    assert _main(["train", "--model", f"{EXAMPLE}:build", "--dataset", "imagefolder", "--data-dir", str(shapes),
                  "--steps", "2", "--devices", "1", "--batch-size", "16", "--quiet", "--no-tensorboard", "--out",
                  str(run)]) == 0
    from conftest import edit_meta

    state = checkpoint.load(run)
    assert state["data"]["split"] == "name-hash"
    del state["data"]["split"]  # as a run of the earlier (position-seeded) split saved it
    edit_meta(run, data=state["data"])
    capsys.readouterr()
    _one_line(capsys, _main(["train", "--resume", str(run), "--steps", "4"]),
              "was made before paratrain chose held-out images by a hash of their names")
