"""End-to-end: `paratrain train` as a user runs it, in fresh processes."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import main_code, max_abs_diff, newest_state, run_cli, train_here, weights
from torch.overrides import TorchFunctionMode

import paratrain

SUMMARY_KEYS = {"model", "dataset", "strategy", "world_size", "global_batch_size", "steps", "epochs",
                "train_time_s", "examples_per_sec", "test_accuracy", "test_loss", "val_accuracy", "seed",
                "torch_version", "devices"}


@pytest.mark.integration
def test_main_command_trains_digits_to_95_percent(tmp_path: Path) -> None:
    """The main command with its defaults (--devices auto), offline."""
    run = tmp_path / "run"
    proc = run_cli("train", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["test_accuracy"] >= 0.95
    assert summary["model"] == "lenet5" and summary["dataset"] == "digits"
    assert summary["examples_per_sec"] > 0 and 0 < summary["train_time_s"]
    assert "test_accuracy" in proc.stdout and "val_accuracy" in proc.stdout  # final line and epoch lines

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    epochs = [r for r in records if "val_accuracy" in r]
    assert steps and {"step", "epoch", "loss", "train_accuracy", "examples_per_sec", "lr", "time_s"} <= steps[0].keys()
    assert len(epochs) == summary["epochs"]
    assert {"epoch", "val_accuracy", "val_loss", "epoch_time_s"} <= epochs[-1].keys()

    ckpt = newest_state(run)
    assert {"model", "optimizer", "step", "epoch", "config"} <= ckpt.keys()
    assert ckpt["step"] == summary["steps"] and ckpt["config"]["model"] == "lenet5"
    assert yaml.safe_load((run / "config.yaml").read_text())["batch_size"] == summary["global_batch_size"]


@pytest.mark.integration
def test_two_workers_equal_one_on_digits(tmp_path: Path) -> None:
    args = ("--steps", "20", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "64")
    one = train_here(tmp_path / "one", *args, "--devices", "1")
    two = train_here(tmp_path / "two", *args, "--devices", "2")
    assert one["world_size"] == 1 and two["world_size"] == 2 and two["strategy"] == "ddp"
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 3e-6  # measured 3.0e-8
    assert two["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=1 / 359)


@pytest.mark.integration
def test_two_workers_equal_one_on_mnist(tmp_path: Path, mnist_dir: Path) -> None:
    """The core promise: 20 SGD steps of LeNet-5 on MNIST, same seed and global batch."""
    # lr 0.01, far from lr 0.05, where float noise between worker counts grew to 1.4e-5 in 20 steps
    args = ("--dataset", "mnist", "--data-dir", str(mnist_dir), "--steps", "20", "--optimizer", "sgd",
            "--lr", "0.01", "--batch-size", "256")
    train_here(tmp_path / "one", *args, "--devices", "1")
    train_here(tmp_path / "two", *args, "--devices", "2")
    diff = max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "two"))
    assert diff < 1.5e-6  # measured 1.5e-8
    # ...and the test can fail: a different data order moves the weights far more than that.
    train_here(tmp_path / "other", *args, "--devices", "1", "--seed", "1")
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "other")) > 1e-2


@pytest.mark.integration
def test_mnist_two_workers_two_epochs_reach_98_percent(tmp_path: Path, mnist_dir: Path) -> None:
    summary = train_here(tmp_path / "run", "--dataset", "mnist", "--data-dir", str(mnist_dir), "--devices", "2",
                    "--epochs", "2", "--batch-size", "128")
    assert summary["world_size"] == 2 and summary["epochs"] == 2
    assert summary["test_accuracy"] >= 0.98


@pytest.mark.integration
def test_eval_reports_the_summary_accuracy(tmp_path: Path) -> None:
    summary = train_here(tmp_path / "run", "--steps", "30", "--devices", "1")
    proc = run_cli("eval", "--checkpoint", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert f"test_accuracy {summary['test_accuracy']:.4f}" in proc.stdout


@pytest.mark.integration
def test_resume_continues_to_the_same_weights(tmp_path: Path) -> None:
    """A run stopped after 15 steps and resumed to 40 ends where a 40-step run ends."""
    args = ("--devices", "1", "--seed", "3", "--dropout", "0.3", "--model", "mnist-net")
    train_here(tmp_path / "whole", *args, "--steps", "40")
    train_here(tmp_path / "part", *args, "--steps", "15")
    proc = run_cli("train", "--quiet", "--resume", str(tmp_path / "part"), "--steps", "40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "part" / "summary.json").read_text())["steps"] == 40
    assert max_abs_diff(weights(tmp_path / "whole"), weights(tmp_path / "part")) < 1e-6


@pytest.mark.integration
def test_cifar10_net_on_real_cifar10(tmp_path: Path, cifar_dir: Path) -> None:
    """The CIFAR-10 path end to end: binary .gz batches, 3 channels, 24x24 centre crops, 2 workers."""
    summary = train_here(tmp_path / "run", "--dataset", "cifar10", "--data-dir", str(cifar_dir), "--model",
                    "cifar10-net", "--devices", "2", "--steps", "30", "--batch-size", "128", "--lr", "1e-3")
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["test_accuracy"] > 0.2  # well above chance after 30 steps


@pytest.mark.integration
def test_synthetic_data_for_throughput(tmp_path: Path) -> None:
    summary = train_here(tmp_path / "run", "--dataset", "synthetic", "--steps", "5", "--devices", "1")
    assert summary["dataset"] == "synthetic" and summary["examples_per_sec"] > 0


@pytest.mark.integration
@pytest.mark.alone  # it compares measured rates: .ci/run runs it with nothing beside
def test_logged_rates_leave_out_evaluation(tmp_path: Path) -> None:
    """A log window that spans the end of an epoch counts neither the evaluation's time nor loses it: its
    examples/sec is in line with the others (it once came out 20x too high)."""
    run = tmp_path / "run"
    train_here(run, "--dataset", "synthetic", "--steps", "100", "--log-every", "15", "--devices", "1")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["step"] % 15 for r in records if "epoch_time_s" in r)  # an epoch ends inside a window
    rates = [r["examples_per_sec"] for r in records if "loss" in r][1:]  # the first window holds warm-up
    assert max(rates) < 5 * statistics.median(rates), rates  # the bug was 20x; a busy machine varies 3x


def test_a_finished_run_resumed_keeps_its_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Resumed with its own steps, a finished run is evaluated again and summary.json keeps the training's
    figures; with fewer steps than it has done, one line says what to do and its files stay as they were."""
    run = tmp_path / "run"
    base = ["--devices", "1", "--steps", "6", "--quiet", "--no-tensorboard", "--out", str(run)]
    assert main_code(["train", *base]) == 0
    first = json.loads((run / "summary.json").read_text())
    assert first["train_time_s"] > 0 and first["examples_per_sec"]
    assert main_code(["train", "--resume", str(run), "--quiet"]) == 0
    again = json.loads((run / "summary.json").read_text())
    kept = ("train_time_s", "examples_per_sec", "world_size", "startup_s", "val_accuracy")
    assert {k: again[k] for k in kept} == {k: first[k] for k in kept}
    assert again["test_accuracy"] == first["test_accuracy"] and again["ended_at"] > first["ended_at"]
    files = {name: (run / name).read_bytes() for name in ("config.yaml", "summary.json", "metrics.jsonl")}
    capsys.readouterr()
    assert main_code(["train", "--resume", str(run), "--steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"paratrain: error: the run in {run} has done 6 steps, more than the 4 asked for; give more steps "
                   f"(--steps or --epochs; steps= or epochs= in Python) to train it further, or evaluate it with "
                   f"`paratrain eval {run}` (paratrain.evaluate)"), err
    assert {name: (run / name).read_bytes() for name in files} == files


@pytest.mark.integration
def test_a_logged_run_has_plain_lines_and_a_resume_says_so(tmp_path: Path) -> None:
    from conftest import run_cli

    run = tmp_path / "r"
    proc = run_cli("train", "--devices", "2", "--steps", "4", "--log-every", "2", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = proc.stdout + proc.stderr  # redirected: no progress bar redrawn with carriage returns
    assert "\r" not in logged and "step 2/4  loss" in proc.stdout and "epoch 1/1" in proc.stdout
    assert "leaked semaphore" not in proc.stderr
    proc = run_cli("train", "--resume", str(run), "--steps", "6", "--devices", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == f"paratrain: resuming {run}, whose newest checkpoint is of step 4"
    assert "leaked semaphore" not in proc.stderr


# ---- what a step asks of the device ----

class _Reads(TorchFunctionMode):
    """The reads of a tensor's value (each one a wait for the device where the tensor is on one), and the numbers
    made on the host for a device (torch.tensor(v, device=...): a copy, which on a GPU waits for the work queued
    before it), that paratrain's own code makes, by the step (or "evaluation") they were made in."""

    READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__bool__, torch.Tensor.cpu)

    def __init__(self) -> None:
        super().__init__()
        self.step: int | str = 0
        self.made: list[tuple[int | str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        copied = func is torch.tensor and kwargs.get("device") is not None
        if func in self.READS or copied:
            frame = sys._getframe(1)  # the caller: of the method itself, or of torch's Python wrapper of it
            if frame.f_code.co_filename == torch._tensor.__file__:  # __float__, __bool__, __int__
                frame = frame.f_back
            if PACKAGE in frame.f_code.co_filename:  # not torch's own (an optimizer's step count, say)
                what = "copy" if copied else func.__name__
                self.made.append((self.step, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {what}"))
        return func(*args, **kwargs)


PACKAGE = str(Path(paratrain.__file__).parent)


@pytest.mark.parametrize("workload", ["lenet5-digits", "gpt-text"])
def test_a_step_that_logs_nothing_reads_the_device_once(workload: str, tmp_path: Path, corpus: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The reads of a value in paratrain's own code during each step of a run that logs nothing (every step but
    the last, which logs): one, the agreement's (every worker learns whether any loss is finite, and whether to
    stop), and no number copied from the host. The text's windows were read through indices kept on the device,
    brought back twice a step. An evaluation's sums stay on the device until its end (which reads them once,
    outside its batches): each batch copied its example count from the host."""
    from paratrain.optimization import evaluation
    from paratrain.training.trainer import Trainer

    reads, ran = _Reads(), []

    def counting(original: Any, step: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            reads.step = step(args)
            ran.append(reads.step)
            with reads:
                return original(*args, **kwargs)
        return counted
    for name in ("_forward_backward", "_agree", "_update", "_after_update"):
        monkeypatch.setattr(Trainer, name, counting(getattr(Trainer, name), lambda args: args[0].state.step + 1))
    monkeypatch.setattr(evaluation, "evaluate_share", counting(evaluation.evaluate_share, lambda _: "evaluation"))
    flags = ("--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--width", "32", "--depth", "1",
             "--heads", "2", "--context", "32", "--batch-size", "8") if workload == "gpt-text" else ()
    train_here(tmp_path / "run", *flags, "--devices", "1", "--steps", "5", "--log-every", "1000", "--no-tensorboard")
    per_step = {step: [where for s, where in reads.made if s == step] for step in range(1, 5)}
    assert all(len(made) == 1 and "copy" not in made[0] for made in per_step.values()), per_step
    assert "evaluation" in ran and [where for s, where in reads.made if s == "evaluation"] == []


def test_an_epochs_order_lives_on_the_host_where_inputs_are_read_from_a_file(tmp_path: Path) -> None:
    """A text's windows (inputs and targets read from its token file) and an image folder's cache (its labels in
    memory) take their indices on the host: on a GPU, an order kept there came back to the host once or twice a
    step. Where the inputs are a tensor on the device, the order indexes it there. (The CPU test of the reads
    above cannot see where the order lives: this can.)"""
    import numpy as np

    from paratrain.data.batches import order_device
    from paratrain.data.source import MappedImages

    np.save(tmp_path / "x.npy", np.zeros((4, 1, 2, 2), dtype=np.uint8))
    mapped, gpu = MappedImages(str(tmp_path / "x.npy")), torch.device("cuda", 0)
    assert order_device((mapped, mapped), gpu) == torch.device("cpu")
    assert order_device((mapped, torch.zeros(4)), gpu) == torch.device("cpu")
    assert order_device((torch.zeros(4, 2), torch.zeros(4)), gpu) == gpu


def test_the_feed_reads_the_next_micro_batch_ahead_and_trains_the_same(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """data/feed.py on a GPU reads micro-batch n + 1 in a thread while n trains, and an epoch's first when it comes:
    the same batches as reading each when asked (here forced on a CPU, where the loop reads them itself), so the
    same weights, over two epochs and with --accumulate; each micro-batch read once."""
    from paratrain.data import feed

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"line {i} of a small text, read a window at a time." for i in range(60)))
    args = ("--dataset", "text", "--data-dir", str(text), "--model", "gpt", "--width", "32", "--depth", "1",
            "--heads", "2", "--context", "32", "--batch-size", "8", "--accumulate", "2", "--devices", "1",
            "--optimizer", "adamw", "--epochs", "2", "--no-tensorboard")
    asked = train_here(tmp_path / "asked", *args)
    reads: list[int] = []
    original = feed.Feed._read

    def counted(self: Any, idx: torch.Tensor) -> Any:
        reads.append(len(idx))
        return original(self, idx)
    monkeypatch.setattr(feed.Feed, "_read", counted)
    monkeypatch.setattr("paratrain.training.trainer.reads_ahead", lambda train, device: True)
    ahead = train_here(tmp_path / "ahead", *args)
    assert ahead["steps"] == asked["steps"] > 2 and ahead["epochs"] == 2
    assert reads == [8] * (asked["steps"] * 2)  # every micro-batch once: none read twice, none past an epoch's end
    assert max_abs_diff(weights(tmp_path / "asked"), weights(tmp_path / "ahead")) == 0


def test_host_data_keeps_the_inputs_in_host_memory_and_trains_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capfd: pytest.CaptureFixture) -> None:
    """--host-data: the inputs held in memory stay on the host, delivered a batch at a time (the evaluation's
    too), and the run is the one that moved them whole: the same weights and test figures (on a CPU, where the
    flag changes nothing, it says so). A dataset that does not fit the device is one line that names the flag."""
    from paratrain.data import Splits, feed
    from paratrain.data.source import HostRows

    args = ("--model", "mlp", "--devices", "1", "--steps", "12", "--optimizer", "adam", "--no-tensorboard")
    whole = train_here(tmp_path / "whole", *args)
    placed: list[Any] = []
    original = feed.placed
    monkeypatch.setattr("paratrain.training.trainer.placed", lambda *a: placed.append(original(*a)) or placed[-1])
    capfd.readouterr()
    host = train_here(tmp_path / "host", *args, "--host-data")
    # a CPU's data is on the host whatever the flag says: said, so that nobody takes it for a change
    assert "note: --host-data changes nothing here: a CPU's data is in host memory already" in capfd.readouterr().err
    assert isinstance(placed[0].train[0], HostRows) and isinstance(placed[0].test[0], HostRows)
    assert max_abs_diff(weights(tmp_path / "whole"), weights(tmp_path / "host")) == 0
    assert (host["test_accuracy"], host["test_loss"]) == (whole["test_accuracy"], whole["test_loss"])

    def too_big(self: Any, device: Any, inputs_on_host: bool = False) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
    monkeypatch.setattr(Splits, "to", too_big)
    capfd.readouterr()
    assert main_code(["train", *args, "--out", str(tmp_path / "big")]) == 2
    said = capfd.readouterr().err.strip().splitlines()
    assert len(said) == 1 and re.search(r"does not fit in cpu's memory .*--host-data keeps it in host", said[0]), said


@pytest.mark.integration
def test_host_data_on_two_workers_with_adam_trains_as_the_dataset_moved_whole(tmp_path: Path) -> None:
    """--host-data's order on the host and its rows delivered a batch at a time, each worker its share of the global
    batch: 2 workers with Adam end with the weights, Adam's moments and the test figures of the move."""
    args = ("--model", "mlp", "--devices", "2", "--steps", "12", "--optimizer", "adam", "--no-tensorboard")
    whole = train_here(tmp_path / "whole", *args)
    host = train_here(tmp_path / "host", *args, "--host-data")
    assert max_abs_diff(weights(tmp_path / "whole"), weights(tmp_path / "host")) == 0
    moments = [newest_state(tmp_path / run)["optimizer"] for run in ("whole", "host")]
    assert moments[0] and max_abs_diff(moments[0], moments[1]) == 0
    assert (host["test_accuracy"], host["test_loss"]) == (whole["test_accuracy"], whole["test_loss"])


def test_host_data_with_named_columns_is_one_line() -> None:
    """Named columns (a Hugging Face batch's) go to the device whole: --host-data says so rather than ignoring it."""
    from paratrain.data import Splits

    columns = ({"input_ids": torch.zeros(4, 3, dtype=torch.int64)}, torch.zeros(4, dtype=torch.int64))
    splits = Splits("cols", columns, columns, columns, (), (), 0)
    with pytest.raises(paratrain.UserError, match="--host-data keeps inputs held as one tensor on the host; these "
                                                  "are named columns"):
        splits.to(torch.device("cpu"), inputs_on_host=True)
