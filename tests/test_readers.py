"""The IDX (MNIST) and CIFAR-10 readers on the real files and on broken ones, and the downloads that fetch
their files: a failed one leaves nothing behind, and a folder of images is never downloaded into."""

from __future__ import annotations

import gzip
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import main_code

import paratrain
from paratrain.core.errors import UserError
from paratrain.data import cifar10, fetch, load_dataset, mnist

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}


def _idx(path: Path, array: np.ndarray, magic: bytes | None = None) -> Path:
    header = magic or bytes([0, 0, 8, array.ndim])
    header += b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())
    return path


def test_real_mnist(mnist_dir: Path) -> None:
    data = load_dataset("mnist", str(mnist_dir), download=False)
    assert [len(p[1]) for p in (data.train, data.val, data.test)] == [55_000, 5_000, 10_000]
    assert data.train[0].shape[1:] == (1, 28, 28) and data.train[0].dtype == torch.uint8
    assert torch.bincount(data.test[1]).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_real_cifar10_binary(cifar_dir: Path) -> None:
    data = load_dataset("cifar10", str(cifar_dir), download=False, val_size=0)
    assert len(data.train[1]) == 50_000 and len(data.test[1]) == 10_000
    assert torch.bincount(data.train[1]).tolist() == [5_000] * 10
    mean = data.train[0].float().mean(dim=(0, 2, 3)) / 255
    assert torch.allclose(mean, torch.tensor(cifar10.MEAN), atol=1e-3)


def test_idx_round_trip_plain_and_gz(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    plain = _idx(tmp_path / "x-idx3-ubyte", images)
    assert torch.equal(mnist.read_idx(plain, 3), torch.as_tensor(images, dtype=torch.uint8))
    gz = tmp_path / "x-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert torch.equal(mnist.read_idx(gz, 3), mnist.read_idx(plain, 3))


def test_idx_wrong_magic(tmp_path: Path) -> None:
    path = _idx(tmp_path / "bad", np.zeros((2, 2, 2)), magic=b"\x00\x00\x0d\x03")
    with pytest.raises(UserError, match="wrong magic"):
        mnist.read_idx(path, 3)


def test_idx_truncated(tmp_path: Path) -> None:
    path = _idx(tmp_path / "short", np.zeros((4, 28, 28)))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"short has .* bytes but its header promises"):
        mnist.read_idx(path, 3)


def test_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    blob = gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 100]) + bytes(100))
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        mnist.read_idx(path, 1)


def test_mnist_missing_files_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="t10k-images-idx3-ubyte, .*not found in"):
        load_dataset("mnist", str(tmp_path), download=False)


def test_mnist_truncated_real_file_named(mnist_dir: Path, tmp_path: Path) -> None:
    for name in mnist.FILES.values():
        shutil.copy(mnist_dir / f"{name}.gz", tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:5000])
    with pytest.raises(UserError, match="train-labels-idx1-ubyte.gz is corrupt or truncated"):
        load_dataset("mnist", str(tmp_path), download=False)


def _cifar_records(n: int, label: int = 3) -> bytes:
    records = np.zeros((n, cifar10.RECORD), dtype=np.uint8)
    records[:, 0] = label
    records[:, 1:1025] = 200  # red plane
    return records.tobytes()


def test_cifar_binary_layout(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(_cifar_records(3))
    images, labels = cifar10.read_binary(path)
    assert images.shape == (3, 3, 32, 32) and labels.tolist() == [3, 3, 3]
    assert images[:, 0].eq(200).all() and images[:, 1:].eq(0).all()  # channel planes in R, G, B order


def test_cifar_binary_truncated(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1.bin.gz"
    path.write_bytes(gzip.compress(_cifar_records(3)[:-7]))
    with pytest.raises(UserError, match="not a whole number of 3073-byte"):
        cifar10.read_binary(path)


def test_cifar_binary_bad_label(tmp_path: Path) -> None:
    path = tmp_path / "test_batch.bin"
    path.write_bytes(_cifar_records(2, label=42))
    with pytest.raises(UserError, match="label above 9"):
        cifar10.read_binary(path)


def _python_batches(folder: Path, n: int = 4) -> None:
    folder.mkdir()
    for name in [*cifar10.TRAIN_BATCHES, "test_batch"]:
        batch = {"data": np.full((n, 3072), 7, dtype=np.uint8), "labels": list(range(n))}
        (folder / name).write_bytes(pickle.dumps(batch))


def test_cifar_python_version(tmp_path: Path) -> None:
    _python_batches(tmp_path / "cifar-10-batches-py")
    data = load_dataset("cifar10", str(tmp_path), download=False, val_size=2)
    assert len(data.train[1]) == 18 and len(data.val[1]) == 2 and len(data.test[1]) == 4
    assert data.test[0].shape == (4, 3, 32, 32) and data.test[0].eq(7).all()


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("code ran",))


def test_cifar_python_pickle_with_code_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({"data": _Evil(), "labels": [0]}))
    with pytest.raises(UserError, match="refusing to load builtins.print"):
        cifar10.read_python(path)


def test_cifar_missing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="CIFAR-10 batches .* not found"):
        load_dataset("cifar10", str(tmp_path), download=False)


def test_digits_embedded() -> None:
    data = load_dataset("digits")
    assert data.train[0].shape[1:] == (1, 28, 28)
    assert sum(len(p[1]) for p in (data.train, data.val, data.test)) == 1797
    assert data.image_size == 28 and data.num_classes == 10


# sha256 of the splits as they were built from scikit-learn's own files before the data moved into the package
# (the embedded datasets train exactly as before): the digits' uint8 images, labels and statistics (from exact
# integer sums); the diabetes targets (exact numbers, so the same rows in each split; its features are floats
# standardised in float64, checked by their statistics)
SPLITS_SHA256 = {"digits": "38933589cc77c60b2c9eebaec594698a9bf52b40167a4f70cecf91d0c6136afc",
                 "diabetes": "7e0e3a3f2c02f9d58f3a5ea5920ad3f4386084f6322f65dfb71e52995a292108"}


@pytest.mark.parametrize("name", sorted(SPLITS_SHA256))
def test_the_packaged_datasets_give_the_splits_scikit_learns_files_gave(name: str) -> None:
    import hashlib

    splits = load_dataset(name)
    digest = hashlib.sha256()
    for part in (splits.train, splits.val, splits.test):
        for t in part if name == "digits" else part[1:]:
            digest.update(t.numpy().tobytes())
    if name == "digits":
        digest.update(repr((splits.mean, splits.std)).encode())
    else:
        assert float(splits.train[0].mean(0).abs().max()) < 1e-6
        assert float((splits.train[0].double().std(0) - 1).abs().max()) < 1e-5
    assert digest.hexdigest() == SPLITS_SHA256[name]


def test_the_packaged_arrays_are_scikit_learns() -> None:
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is not installed (not needed to train)")
    from paratrain.data import bundled, digits

    images, labels = digits._arrays()
    bunch = datasets.load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
    table = datasets.load_diabetes(scaled=False)
    shipped = bundled.packaged("diabetes")
    assert np.array_equal(shipped["data"], table.data) and np.array_equal(shipped["target"], table.target)


def test_failed_download_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error

    import torchvision

    def offline(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(UserError, match="could not download MNIST .*pass --data-dir"):
        load_dataset("mnist", str(tmp_path), download=True)
    with pytest.raises(UserError, match="could not download CIFAR-10 .*pass --data-dir"):
        load_dataset("cifar10", str(tmp_path), download=True)


def test_cifar_archive_is_extracted_safely_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An official-looking archive in --data-dir is unpacked (with the 'data' filter) and read, once its MD5
    is the official one's (here: this archive's own, as the official file is not at hand)."""
    import hashlib
    import tarfile

    src = tmp_path / "src" / "cifar-10-batches-bin"
    src.mkdir(parents=True)
    record = bytes([7]) + bytes(3072)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (src / f"{name}.bin").write_bytes(record * 3)
    data = tmp_path / "data"
    data.mkdir()
    with tarfile.open(data / "cifar-10-binary.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-bin")
    digest = hashlib.md5((data / "cifar-10-binary.tar.gz").read_bytes()).hexdigest()
    monkeypatch.setitem(cifar10.ARCHIVE_MD5, "cifar-10-binary.tar.gz", digest)
    splits = cifar10.load(str(data), download=False, val_size=5)
    assert len(splits.train[1]) == 10 and len(splits.test[1]) == 3 and int(splits.test[1][0]) == 7


def test_a_download_that_fails_its_md5_is_refused_and_deleted(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The CIFAR-10 download goes through torchvision's download_url with the official MD5: a file that
    arrives changed (a proxy's error page, a truncated transfer) is refused, deleted, and nothing unpacked."""
    import torchvision.datasets.utils as tv

    from paratrain.data import cifar10

    served = []

    def serve_junk(url: str, path: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        served.append(url)
        Path(path).write_bytes(b"<html>not the archive</html>")

    monkeypatch.setattr(tv, "_get_redirect_url", lambda url, max_hops=3: url)
    monkeypatch.setattr(tv, "_urlretrieve", serve_junk)
    folder = tmp_path / "cifar"
    with pytest.raises(UserError, match="could not download CIFAR-10 .*File not found or corrupted"):
        cifar10.load(str(folder), download=True, val_size=None)
    assert served == [cifar10.URL] and not folder.exists()  # deleted, and the folder it made too


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
