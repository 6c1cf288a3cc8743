"""No input file or value makes a run use gigabytes before it is checked, nor write where it should not.

The bombs run in a fresh `paratrain` process each, whose peak memory (ru_maxrss from wait4) is compared with
that of the same command on a missing dataset: each is refused in one line, exit 2, under 200 MB above it.
"""

from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

import paratrain
from paratrain.cli import main
from paratrain.core.errors import UserError
from paratrain.data import cifar10, mnist

MB = 2**20
IDX_HEADER = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in (60_000, 28, 28))


def _measure(*args: str) -> tuple[int, str, int]:
    """`python -m paratrain ARGS` in a fresh process: (exit code, stderr, peak resident memory in bytes)."""
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    err = proc.stderr.read()  # to its end; then wait4, not Popen, reaps the child, with its usage
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it is reaped
    return proc.returncode, err.decode(errors="replace"), usage.ru_maxrss * 1024


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Peak memory of a run refused for a missing dataset: torch imported, nothing read."""
    empty = tmp_path_factory.mktemp("empty")
    code, err, peak = _measure("train", "--dataset", "mnist", "--data-dir", str(empty), "--no-download",
                               "--out", str(empty / "run"))
    assert code == 2 and "not found" in err
    return peak


def _refused(baseline: int, message: str, *args: str) -> str:
    code, err, peak = _measure(*args)
    assert peak - baseline < 200 * MB, f"peak {peak / MB:.0f} MB against {baseline / MB:.0f} MB at the start"
    lines = [line for line in err.strip().splitlines() if "Warning" not in line and line.strip()]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and message in lines[0] and len(lines[0]) < 1000, err[-2000:]
    return lines[0]


def _mnist_folder(folder: Path, train_images: bytes, name: str = "train-images-idx3-ubyte.gz") -> Path:
    folder.mkdir()
    for stem in mnist.FILES.values():  # the others only need to exist: the training images are read first
        (folder / f"{stem}.gz").write_bytes(gzip.compress(b""))
    (folder / name).write_bytes(train_images)
    return folder


def _gzip_zeros(prefix: bytes, zeros: int) -> bytes:
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip stream
    parts = [packer.compress(prefix)]
    block = bytes(16 * MB)
    for _ in range(zeros // len(block)):
        parts.append(packer.compress(block))
    return b"".join(parts) + packer.flush()


@pytest.mark.integration
def test_a_gzip_bomb_stops_at_what_the_header_promises(tmp_path: Path, baseline: int) -> None:
    # a 1 MB .gz that unpacks to 1 GB: its header promises 47 MB
    folder = _mnist_folder(tmp_path / "d", _gzip_zeros(IDX_HEADER, 1024 * MB))
    _refused(baseline, "holds more than its header promises", "train", "--dataset", "mnist", "--data-dir",
             str(folder), "--no-download", "--out", str(tmp_path / "run"))


@pytest.mark.integration
@pytest.mark.parametrize("dims", [(2**31, 28, 28), (2**32 - 1, 2**32 - 1, 2**32 - 1)])  # past int64 too
def test_an_idx_header_that_claims_too_much_is_refused_before_reading(tmp_path: Path, baseline: int,
                                                                      dims: tuple[int, ...]) -> None:
    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in dims)
    folder = _mnist_folder(tmp_path / "d", header + bytes(1000), name="train-images-idx3-ubyte")
    (folder / "train-images-idx3-ubyte.gz").unlink()
    os.truncate(folder / "train-images-idx3-ubyte", 2**33)  # sparse: 8 GB on paper, nothing on disk
    _refused(baseline, "its header describes", "train", "--dataset", "mnist", "--data-dir", str(folder),
             "--no-download", "--out", str(tmp_path / "run"))


@pytest.mark.integration
def test_a_cifar_pickle_of_lists_is_refused_before_it_is_converted(tmp_path: Path, baseline: int) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    row = [0] * 3072
    blob = pickle.dumps({"data": [row] * 600_000, "labels": [0] * 600_000})  # 1.8 GB as an array
    assert len(blob) < 5 * MB
    for name in [*cifar10.TRAIN_BATCHES, "test_batch"]:
        (folder / name).write_bytes(blob)
    _refused(baseline, "not an N x 3072 array of uint8", "train", "--dataset", "cifar10", "--model", "cifar10-net",
             "--data-dir", str(tmp_path), "--no-download", "--out", str(tmp_path / "run"))


@pytest.mark.integration
def test_a_yaml_of_nested_aliases_is_refused_with_a_short_line(tmp_path: Path, baseline: int) -> None:
    # under lr: nine levels of nine aliases of the level below, 9^9 leaves when anything walks it (its repr
    # in an error message took 9.3 GB)
    levels = ["&a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"&{name} [{', '.join([f'*{prev}'] * 9)}]")
    (tmp_path / "bomb.yaml").write_text(f"lr: [{', '.join(levels)}]\n")
    assert (tmp_path / "bomb.yaml").stat().st_size < 1024
    _refused(baseline, "key 'lr' must be a single value, not a list", "train", "--config",
             str(tmp_path / "bomb.yaml"), "--out", str(tmp_path / "run"))


def test_an_archive_that_is_not_the_official_one_is_not_extracted(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(__file__, arcname="cifar-10-batches-py/data_batch_1")
    with pytest.raises(UserError, match="is not the official archive"):
        paratrain.fit(None, "cifar10", paratrain.TrainConfig(model="cifar10-net", data_dir=str(tmp_path),
                                                             out=str(tmp_path / "run"), download=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-python.tar.gz"]  # nothing extracted


def test_an_archive_bomb_is_refused_by_its_size_and_member_count(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(cifar10, "MAX_ARCHIVE_BYTES", MB)  # the real cap is 400 MB: the same rule, smaller
    big = tmp_path / "big.tar.gz"
    with tarfile.open(big, "w:gz") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = 2 * MB
        tar.addfile(info, __import__("io").BytesIO(bytes(2 * MB)))
    with pytest.raises(UserError, match="would unpack to 2,097,152 bytes"):
        cifar10.extract_safely(big, tmp_path / "out")
    many = tmp_path / "many.tar.gz"
    with tarfile.open(many, "w:gz") as tar:
        for i in range(cifar10.MAX_ARCHIVE_MEMBERS + 1):
            tar.addfile(tarfile.TarInfo(f"f{i}"))
    with pytest.raises(UserError, match=f"more than {cifar10.MAX_ARCHIVE_MEMBERS} members"):
        cifar10.extract_safely(many, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_oversubscription_is_bounded(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["train", "--devices", "100000", "--oversubscribe", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "at most 4 workers a core" in err and len(err.strip().splitlines()) == 1


def test_the_batch_is_checked_before_any_worker_starts(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                       monkeypatch) -> None:  # noqa: ANN001
    from paratrain.parallel import launch

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were started")

    monkeypatch.setattr(launch, "run", no_launch)
    assert main(["train", "--devices", "6", "--oversubscribe", "--batch-per-worker", "1000",
                 "--out", str(tmp_path / "run")]) == 2
    assert "is more than the 1294 training examples; lower them" in capsys.readouterr().err


def test_an_out_others_can_write_or_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (shared / "config.yaml").symlink_to(victim)  # planted by someone who could write there
    shared.chmod(0o777)
    cfg = paratrain.TrainConfig(steps=1, out=str(shared), quiet=True, tensorboard=False, devices="1")
    with pytest.raises(UserError, match="can be written by every user"):
        paratrain.fit(None, "digits", cfg)
    assert victim.read_text() == "precious\n" and sorted(p.name for p in shared.iterdir()) == ["config.yaml"]
    if os.geteuid() != 0:
        pytest.skip("handing a folder to another user needs root (chown)")
    shared.chmod(0o755)
    os.chown(shared, 65534, 65534)  # nobody
    with pytest.raises(UserError, match="belongs to another user"):
        paratrain.fit(None, "digits", cfg)
    assert victim.read_text() == "precious\n"


def test_files_of_the_run_replace_links_instead_of_following_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("config.yaml", "summary.json"):
        (run / name).symlink_to(victim)
    with pytest.raises(UserError, match="holds a finished run"):  # the links look like a run: refused first
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), quiet=True, tensorboard=False,
                                                            devices="1"))
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), quiet=True, tensorboard=False,
                                                        devices="1", overwrite=True))
    assert victim.read_text() == "precious\n"
    assert not (run / "config.yaml").is_symlink() and "steps: 2" in (run / "config.yaml").read_text()
    assert not (run / "summary.json").is_symlink()
    # and a link planted after the start is replaced, not written through
    (run / "summary.json").unlink()
    (run / "summary.json").symlink_to(victim)
    from paratrain.core.outputs import write_atomic

    write_atomic(run / "summary.json", "{}\n")
    assert victim.read_text() == "precious\n" and not (run / "summary.json").is_symlink()


def test_eval_reads_data_where_the_command_line_says_not_the_checkpoint(tmp_path: Path,
                                                                        monkeypatch) -> None:  # noqa: ANN001

    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "run"), quiet=True,
                                                        tensorboard=False, devices="1"))
    from conftest import edit_meta, newest_state

    target = tmp_path / "chosen-by-the-checkpoint"
    saved = newest_state(tmp_path / "run")["config"]
    edit_meta(tmp_path / "run", config={**saved, "dataset": "mnist", "data_dir": str(target), "download": True})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="not found in data/mnist"):
        paratrain.evaluate(tmp_path / "run", download=False)
    assert not target.exists()


def test_a_yaml_integer_past_pythons_digit_limit_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "big.yaml").write_text("steps: " + "1" * 5000 + "\n")
    assert main(["train", "--config", str(tmp_path / "big.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a value that cannot be read" in err and len(err.splitlines()) == 1 and len(err) < 1000


@pytest.mark.parametrize("planted", ["checkpoints", "tb", "metrics.jsonl"])
def test_a_link_or_a_file_where_the_run_keeps_its_folders_and_log_is_refused(tmp_path: Path, planted: str,
                                                                               capsys: pytest.CaptureFixture) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / planted).symlink_to(elsewhere)
    assert main(["train", "--steps", "1", "--devices", "1", "--out", str(run)]) == 2
    assert f"holds a link named {planted}" in capsys.readouterr().err
    assert not any(elsewhere.iterdir()) and sorted(p.name for p in run.iterdir()) == [planted]


def test_long_values_are_cut_in_messages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.yaml").write_text("model: " + "x" * 200_000 + "\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 2
    with pytest.raises(SystemExit):  # argparse's own refusal of a choice
        main(["train", "--model", "y" * 200_000])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(len(line) < 1100 for line in err) and "unknown model" in err[0]
    assert main(["train", "--out", str(tmp_path / ("z" * 300))]) == 2
    assert "cannot be used" in capsys.readouterr().err
