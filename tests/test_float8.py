"""--precision float8 (features/float8.py): torchao's float8 linear layers on GPUs of compute capability 8.9 or
later; refused in one line on CPUs, on older GPUs (naming their capability), without torchao, and under the
strategies that do not take it yet. On such a GPU (marked gpu): the gpt trains in float8 to about bf16's loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FakeGPUs, main_code

from paratrain import config
from paratrain.core.errors import UserError
from paratrain.core.optional import installed
from paratrain.features.float8 import takes
from paratrain.parallel.strategies import checked
from paratrain.runtime.devices import Hardware, check_float8


def test_a_cpu_run_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main_code(["train", "--precision", "float8", "--devices", "1", "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--precision float8 needs GPUs of compute capability 8.9 or later" in err[0] and "on CPUs" in err[0]
    assert not (tmp_path / "r").exists()


def test_an_older_gpu_is_named_with_its_capability(fake_gpus: FakeGPUs) -> None:
    fake_gpus(2, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    with pytest.raises(UserError, match=r"GPU 0 \(NVIDIA A100-SXM4-80GB\) has 8\.0; use --precision bf16"):
        check_float8(Hardware("gpu", 2, 1, "nccl"))


def test_a_new_enough_gpu_needs_torchao(fake_gpus: FakeGPUs) -> None:
    fake_gpus(1, capability=(8, 9))
    if installed("torchao"):
        check_float8(Hardware("gpu", 1, 1, "nccl"))
        return
    with pytest.raises(UserError, match=r"needs torchao, which is not installed: pip install 'paratrain\[float8\]'$"):
        check_float8(Hardware("gpu", 1, 1, "nccl"))


def test_the_strategies_that_do_not_take_it_say_so() -> None:
    for values, said in (({"strategy": "pipeline", "stages": 2}, "not available with --strategy pipeline yet"),
                         ({"strategy": "tower"}, "not available with --strategy tower"),
                         ({"strategy": "tp"}, "--precision float8 is not available with --strategy tp")):
        with pytest.raises(UserError, match=said):
            checked(config.validate(config.TrainConfig(precision="float8", **values)))
    for strategy in ("ddp", "fsdp", "hsdp"):
        checked(config.validate(config.TrainConfig(precision="float8", strategy=strategy)))


def test_the_linear_layers_whose_sizes_are_multiples_of_16_compute_in_float8() -> None:
    assert takes(torch.nn.Linear(64, 256), "blocks.0.up")
    assert not takes(torch.nn.Linear(64, 10), "head") and not takes(torch.nn.Conv2d(16, 16, 3), "conv")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9)
                    or not installed("torchao"), reason="needs a GPU of compute capability 8.9+ and torchao")
def test_the_gpt_trains_in_float8_to_about_bf16s_loss(tmp_path: Path, corpus: Path) -> None:
    from conftest import train

    flags = ("--dataset", "text", "--data-dir", str(corpus), "--model", "gpt", "--width", "256", "--depth", "4",
             "--context", "128", "--batch-size", "32", "--steps", "200", "--optimizer", "adamw", "--lr", "1e-3",
             "--accelerator", "gpu", "--devices", "1", "--no-tensorboard")
    bf16 = train(tmp_path / "bf16", *flags, "--precision", "bf16")
    f8 = train(tmp_path / "f8", *flags, "--precision", "float8")
    assert f8["val_loss"] < 3.0 and abs(f8["val_loss"] - bf16["val_loss"]) < 0.1, (f8["val_loss"], bf16["val_loss"])
