"""Bad input: one line on stderr naming the problem and the fix, exit code 2, no traceback; and the flags' help,
which says what each does (a mistyped flag is named, never taken as an abbreviation)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import main_code, run_cli, save_step

from paratrain.cli import main
from paratrain.data import folder


def _one_line_error(capsys: pytest.CaptureFixture, code: int, expected: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("paratrain: error:") and expected in err, err
    assert "Traceback" not in err


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors leave through SystemExit
        return int(e.code)


@pytest.mark.parametrize("argv,expected", [
    (["train", "--model", "resnet"], "invalid choice: 'resnet'"),
    (["train", "--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["train", "--optimizer", "lbfgs"], "invalid choice: 'lbfgs'"),
    (["train", "--lr", "0"], "--lr must be a positive number"),
    (["train", "--lr=-1e-3"], "--lr must be a positive number"),
    (["train", "--lr", "nan"], "--lr must be a positive number"),
    (["train", "--lr", "fast"], "invalid float value: 'fast'"),
    (["train", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["train", "--epochs", "0"], "--epochs must be at least 1"),
    (["train", "--steps=-5"], "--steps must be at least 1"),
    (["train", "--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["train", "--devices", "two"], "--devices must be 'auto' or a positive number"),
    (["train", "--devices", "10000"], "use --devices"),
    (["train", "--devices", "2", "--batch-size", "63"], "does not split evenly over 2 workers"),
    (["train", "--devices", "1", "--batch-size", "100000"], "more than the 1294 training examples"),
    (["train", "--threads-per-worker", "64", "--devices", "1"], "exceed the"),
    (["train", "--accelerator", "gpu"], "--accelerator cpu"),  # conftest hides any GPU from these tests
    (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["train", "--strategy", "tower", "--devices", "2", "--batch-size", "63"], "split evenly over 2 towers"),
    (["train", "--strategy", "horovod"], "invalid choice: 'horovod'"),
    (["train", "--precision", "8"], "invalid choice: '8'"),
    (["train", "--ema", "1.5"], "--ema must be a decay in (0, 1)"),
    (["train", "--eval-ema"], "--eval-ema needs --ema DECAY"),
    (["train", "--accumulate", "0"], "--accumulate must be at least 1"),
    (["train", "--max-time", "0"], "--max-time must be a positive number"),
    (["train", "--clip-grad-norm=-1"], "--clip-grad-norm must be a positive number"),
    (["train", "--lr-schedule", "step", "--lr-decay-steps", "10", "--lr-decay-rate", "2"],
     "--lr-decay-rate must be in (0, 1]"),
    (["train", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    # a flag the run's optimizer or schedule would not read (Adam is the default optimizer)
    (["train", "--momentum", "0.5"], "--momentum is not read by --optimizer adam, only by --optimizer sgd or rmsprop: "
                                     "drop it, or choose one of those"),
    (["train", "--optimizer", "sgd", "--beta1", "0.8"], "--beta1 is not read by --optimizer sgd"),
    (["train", "--optimizer", "rmsprop", "--nesterov"], "--nesterov is not read by --optimizer rmsprop"),
    (["train", "--lr-decay-steps", "10"], "--lr-decay-steps is not read by --lr-schedule constant, only by "
                                          "--lr-schedule exponential or step"),
    (["train", "--lr-schedule", "step", "--lr-decay-steps", "10", "--lr-decay-epochs", "2"],
     "--lr-decay-steps or --lr-decay-epochs, not both"),
    (["train", "--optimizer", "sgd", "--nesterov", "--momentum", "0"], "--nesterov needs --momentum above 0"),
    (["bench", "--repeats", "0", "--out", "x"], "--repeats must be at least 1"),
    (["plan", "--results", "/nonexistent"], "cannot read bench results"),
    (["fly"], "invalid choice: 'fly'"),
])
def test_bad_flags(argv: list[str], expected: str, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _one_line_error(capsys, _main([*argv, "--out", str(tmp_path / "run")] if argv[0] == "train" else argv),
                    expected)


def test_missing_mnist_files(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code = _main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-download"])
    _one_line_error(capsys, code, "train-images-idx3-ubyte")


def test_corrupt_mnist_file(capsys: pytest.CaptureFixture, tmp_path: Path, mnist_dir: Path) -> None:
    import shutil

    for f in mnist_dir.glob("*-ubyte.gz"):
        shutil.copy(f, tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b not really gzip")
    code = _main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-download"])
    _one_line_error(capsys, code, "t10k-images-idx3-ubyte.gz is corrupt")


@pytest.mark.parametrize("yaml_text,expected", [
    ("learning_rate: 0.1\n", "unknown config key(s): learning_rate"),
    ("lr: [1, 2]\n", "key 'lr' must be a single value, not a list"),
    ("- just\n- a list\n", "must be a mapping"),
    ("lr: 0.1\n  bad: indent\n", "is not valid YAML"),
    ("batch_size: 3.5\n", "config key 'batch_size' has an invalid value"),
])
def test_bad_yaml(yaml_text: str, expected: str, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    _one_line_error(capsys, _main(["train", "--config", str(path)]), expected)


def test_missing_config_file(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _one_line_error(capsys, _main(["train", "--config", str(tmp_path / "nope.yaml")]), "cannot read config file")


def test_unreadable_checkpoint(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    _one_line_error(capsys, _main(["eval", "--checkpoint", str(bad)]), "is unreadable")


def test_missing_checkpoint(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _one_line_error(capsys, _main(["eval", "--checkpoint", str(tmp_path / "none.pt")]), "does not exist")
    (tmp_path / "notarun").mkdir()  # a folder, but no run's: said so, not a file it never had
    _one_line_error(capsys, _main(["eval", str(tmp_path / "notarun")]), "notarun holds no checkpoint (no step "
                    "checkpoint in")


def test_checkpoint_that_is_not_paratrains(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    _one_line_error(capsys, _main(["eval", "--checkpoint", str(path)]), "not a paratrain checkpoint")
    torch.save({"w": torch.zeros(2)}, path)  # weights alone, as `paratrain export` writes them: where they came from
    _one_line_error(capsys, _main(["eval", str(path)]), "holds weights alone (a state dict, as paratrain export "
                    "writes it), without the run's options and data: pass the run directory it came from")


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (print, ("code ran",))


def test_checkpoint_with_code_is_refused(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": _Evil(), "optimizer": {}, "step": 0, "epoch": 0, "config": {}}, path)
    _one_line_error(capsys, _main(["eval", "--checkpoint", str(path)]), "was refused")
    assert "code ran" not in capsys.readouterr().out


def test_checkpoint_of_another_model(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from paratrain.config import TrainConfig
    from paratrain.models import build_model

    # A checkpoint whose config claims lenet5 but whose weights are an MLP's.
    weights = build_model("mlp", 1, 28, 10, width=16, depth=1).state_dict()
    cfg = TrainConfig(model="lenet5").to_dict()
    path = tmp_path / "mixed.pt"
    torch.save({"model": weights, "optimizer": {}, "step": 1, "epoch": 0, "config": cfg}, path)
    _one_line_error(capsys, _main(["eval", "--checkpoint", str(path)]),
                    "holds weights of another shape than this lenet5")


def test_resume_with_another_model(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from paratrain import config
    from paratrain.models import build_model

    run = tmp_path / "run"
    cfg = config.TrainConfig(model="lenet5", out=str(run))
    run.mkdir()
    config.save_yaml(cfg, run / "config.yaml")
    save_step({"model": build_model("lenet5", 1, 32, 10).state_dict(), "optimizer": {}, "step": 1,
               "epoch": 0, "config": cfg.to_dict()}, run / "checkpoints", 1)
    _one_line_error(capsys, _main(["train", "--resume", str(run), "--model", "mlp"]),
                    "is of model 'lenet5', not 'mlp'")


def test_resume_of_a_folder_that_is_no_run(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _one_line_error(capsys, _main(["train", "--resume", str(tmp_path)]), "no config.yaml there")
    _one_line_error(capsys, _main(["train", "--resume", str(tmp_path / "nowhere")]),
                    f"--resume {tmp_path / 'nowhere'}: there is no such folder")


@pytest.mark.integration
def test_errors_from_a_real_process_have_no_traceback(tmp_path: Path) -> None:
    """The same promise, seen from a shell: exit status 2 and one line."""
    proc = run_cli("train", "--batch-size", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["paratrain: error: --batch-size must be at least 1, not 0"]
    proc = run_cli("train", "--devices", "2", "--batch-size", "65", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ---- a table of bad dataset files, built small in a temporary folder ----

def _idx(dims: list[int], magic_type: int = 0x08) -> bytes:
    header = bytes([0, 0, magic_type, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    count = 1
    for d in dims:
        count *= d
    return header + bytes(i % 10 for i in range(count))


def _mnist(folder: Path, **override: bytes) -> None:
    """Four small, valid IDX files (20 train, 10 test examples), some of them replaced."""
    files = {"train-images-idx3-ubyte": _idx([20, 28, 28]), "train-labels-idx1-ubyte": _idx([20]),
             "t10k-images-idx3-ubyte": _idx([10, 28, 28]), "t10k-labels-idx1-ubyte": _idx([10])}
    files.update({k.replace("_", "-"): v for k, v in override.items()})
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _cifar_bin(folder: Path, last: bytes | None = None) -> None:
    record = bytes([3]) + bytes(3072)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / f"{name}.bin").write_bytes(record * 4)
    if last is not None:
        (folder / "test_batch.bin").write_bytes(last)


def _cifar_pickle(folder: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("code ran",))

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps({"data": Evil(), "labels": [1]}))


def _tar(folder: Path, member: str, data: bytes = b"x", link_to: str | None = None) -> None:
    import io
    import tarfile

    with tarfile.open(folder / "cifar-10-python.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(member)
        if link_to:
            info.type, info.linkname = tarfile.SYMTYPE, link_to
            tar.addfile(info)
            return
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


BAD_DATA = [
    ("mnist", lambda d: _mnist(d, train_images_idx3_ubyte=_idx([20, 28, 28])[:-100]), "truncated or corrupt"),
    ("mnist", lambda d: _mnist(d, train_labels_idx1_ubyte=_idx([20], magic_type=0x0D)), "wrong magic number"),
    ("mnist", lambda d: _mnist(d, t10k_images_idx3_ubyte=_idx([10, 28]) ), "wrong magic number"),
    ("mnist", lambda d: _mnist(d, t10k_labels_idx1_ubyte=_idx([9])), "differ in count"),
    ("mnist", lambda d: _mnist(d, train_labels_idx1_ubyte=_idx([20])[:8] + bytes([12] * 20)), "class above 9"),
    ("mnist", lambda d: _mnist(d, train_images_idx3_ubyte=b""), "wrong magic number"),
    ("cifar10", lambda d: _cifar_bin(d, last=bytes(3073 * 2 + 5)), "not a whole number of 3073-byte"),
    ("cifar10", lambda d: _cifar_bin(d, last=bytes([11]) + bytes(3072)), "label above 9"),
    ("cifar10", _cifar_pickle, "not a readable CIFAR-10 python batch"),
    ("cifar10", lambda d: _tar(d, "../escaped.txt"), "unsafe member"),
    # the 'data' filter strips the leading slash: the member lands inside the folder, then no batches are found
    ("cifar10", lambda d: _tar(d, "/tmp/absolute-paratrain-test.txt"), "CIFAR-10 batches"),
    ("cifar10", lambda d: _tar(d, "cifar-10-batches-py/data_batch_1", link_to="../../../etc/passwd"),
     "unsafe member"),
    ("cifar10", lambda d: (d / "cifar-10-python.tar.gz").write_bytes(b"not a tar"), "not a readable tar archive"),
]


@pytest.mark.parametrize(("dataset", "make", "expected"), BAD_DATA)
def test_bad_dataset_files(dataset: str, make, expected: str, capsys: pytest.CaptureFixture,  # noqa: ANN001
                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.data import cifar10

    # These archives are not the official ones, which the MD5 check refuses first (test_hostile_inputs):
    # let them through it, to reach the checks of what is inside.
    monkeypatch.setattr(cifar10, "check_archive", lambda archive: None)
    data = tmp_path / "data"
    data.mkdir()
    make(data)
    code = _main(["train", "--dataset", dataset, "--data-dir", str(data), "--no-download", "--steps", "1",
                  "--out", str(tmp_path / "run")])
    _one_line_error(capsys, code, expected)
    assert "code ran" not in capsys.readouterr().out
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/absolute-paratrain-test.txt").exists()
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("argv,expected", [
    (["train", "--collective-timeout", "0"], "--collective-timeout must be a positive number"),
    (["train", "--max-restarts=-1"], "--max-restarts must not be negative"),
    (["train", "--strategy", "pipeline", "--stages", "1"], "needs --stages K, 2 or more"),
    (["train", "--microbatches", "0"], "--microbatches must be at least 1"),
    (["train", "--filters", "0"], "--filters must be at least 1"),
    (["train", "--model", "convnet", "--kernel", "30", "--devices", "1", "--steps", "1"],
     "--kernel 30 leaves no image"),
    (["train", "--strategy", "hybrid", "--stages", "2", "--precision", "16-mixed"],
     "--precision 16-mixed is not available with --strategy hybrid: fp16's loss scaling skips"),
])
def test_bad_fault_and_pipeline_flags(argv: list[str], expected: str, capsys: pytest.CaptureFixture,
                                      tmp_path: Path) -> None:
    _one_line_error(capsys, _main([*argv, "--out", str(tmp_path / "run")]), expected)


def _unwritable(tmp_path: Path, kind: str) -> str:
    """An --out that is a file, under a file (its parent cannot be made), or in a read-only folder."""
    if kind == "file":
        (tmp_path / "taken").write_text("x")
        return str(tmp_path / "taken")
    if kind == "under-a-file":
        (tmp_path / "taken").write_text("x")
        return str(tmp_path / "taken" / "run")
    if os.geteuid() == 0:  # root writes into any mode; /proc takes no new folders even from root
        return "/proc/paratrain-test/run"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return str(locked / "run")


@pytest.mark.parametrize("kind", ["file", "under-a-file", "read-only"])
@pytest.mark.parametrize("command", [
    ["train", "--steps", "1"],
    ["bench", "--dataset", "synthetic", "--steps", "2", "--configs", "cpu:1t"],
    ["search", "--space", "mlp-mnist", "--trials", "1"],
    ["report", "RUN"],
    ["plan", "--results", "RUN", "--no-validate"],
], ids=lambda c: c[0] if isinstance(c, list) else c)
def test_out_that_cannot_be_written(command: list[str], kind: str, capsys: pytest.CaptureFixture,
                                    tmp_path: Path) -> None:
    """Checked first, before any data is loaded: one line and exit 2, nothing written, not a traceback."""
    out = _unwritable(tmp_path, kind)
    before = sorted(tmp_path.rglob("*"))
    argv = [str(tmp_path / "no-run") if a == "RUN" else a for a in command]
    _one_line_error(capsys, _main([*argv, "--out", out]), "--out")
    assert sorted(tmp_path.rglob("*")) == before


def test_a_config_files_setting_that_the_run_would_not_read_is_a_warning(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """A file may be another run's config.yaml (every field, the defaults too): a setting of its own that the
    optimizer does not read is named in a warning; a copy of a default is not; the run goes on."""
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: adam\nmomentum: 0.5\nbeta1: 0.9\nsteps: 1\n")
    args = ["train", "--config", str(path), "--devices", "1", "--quiet", "--no-tensorboard"]
    assert _main([*args, "--out", str(tmp_path / "a")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("paratrain:")]
    assert said == [f"paratrain: warning: momentum is not read by optimizer adam, only by optimizer sgd or rmsprop, "
                    f"in {path}; it is ignored"], said
    path.write_text("optimizer: adam\nmomentum: 0.9\nsteps: 1\n")  # the default's value: any run's config.yaml
    assert _main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_decay_period_flag_wins_over_the_files_other_unit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The file decays every 10 steps, the flag every 2 epochs: the flag's period is the run's (the steps won
    before), as --epochs wins over the file's steps; a file that holds both units is warned of (its steps win)."""
    from paratrain.cli import build_parser, resolve_config

    path = tmp_path / "c.yaml"
    path.write_text("lr_schedule: step\nlr_decay_steps: 10\nsteps: 50\n")
    cfg = resolve_config(build_parser().parse_args(["train", "--config", str(path), "--lr-decay-epochs", "2",
                                                    "--epochs", "3"]))
    assert (cfg.lr_decay_steps, cfg.lr_decay_epochs, cfg.steps, cfg.epochs) == (None, 2.0, None, 3)
    assert "warning" not in capsys.readouterr().err
    path.write_text("lr_schedule: step\nlr_decay_steps: 10\nlr_decay_epochs: 2\n")
    cfg = resolve_config(build_parser().parse_args(["train", "--config", str(path)]))
    assert cfg.lr_decay_steps == 10
    assert capsys.readouterr().err.strip() == (f"paratrain: warning: lr_decay_steps and lr_decay_epochs are both set: "
                                               f"the steps are the decay period, in {path}")


def test_flags_say_what_they_do_once_and_are_never_abbreviated(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):  # the tool's first words say what it does now, not what it began as
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Train a PyTorch network (images, tables, text, a language model to fine-tune)" in text
    assert "classic image classifiers" not in text
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


def test_eval_of_a_gray_network_on_colour_images_is_refused_before_decoding(
        digits_run: Path, shapes: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("the folder was decoded before the refusal")

    monkeypatch.setattr(folder, "build_cache", no_decoding)
    code = main_code(["eval", str(digits_run), "--dataset", "imagefolder", "--data-dir", str(shapes)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "trained on digits images of 1 channel in 10 classes" in err[0] and "holds colour images" in err[0], err


def test_eval_with_a_factory_for_a_built_in_network_says_to_drop_the_flag(digits_run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "nets.py").write_text("from torch import nn\n\ndef mine():\n    return nn.Linear(64, 10)\n")
    code = main_code(["eval", str(digits_run), "--model", f"{tmp_path / 'nets.py'}:mine"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "holds a lenet5 (a built-in network, built from its checkpoint): drop --model" in err[0], err
    assert "model=" not in err[0], err


def test_the_help_and_the_commands_that_train_nothing_start_without_torch() -> None:
    """--help, `paratrain recipes` and `submit --dry-run` answer in a moment: the command line is built, and those
    commands run, without importing torch (3 s of a start here, and most of the default tier's docs blocks)."""
    import subprocess
    import sys

    check = ("import sys\nfrom paratrain.cli import build_parser, main\nbuild_parser()\n"
             "main(['recipes'])\nmain(['submit', '--dry-run', '--cpus-per-task', '2', 'train', '--epochs', '1'])\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mnist-fast" in done.stdout and "#SBATCH" in done.stdout
