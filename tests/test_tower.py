"""The tower strategy (one process, parameters on one device) equals DDP and one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import max_abs_diff, train_here, weights

from paratrain.models.tower import Tower


@pytest.mark.integration
def test_tower_equals_ddp_equals_single_device(tmp_path: Path, mnist_dir: Path) -> None:
    args = ("--dataset", "mnist", "--data-dir", str(mnist_dir), "--steps", "10", "--optimizer", "sgd",
            "--lr", "0.05", "--batch-size", "256")
    single = train_here(tmp_path / "single", *args, "--devices", "1")
    ddp = train_here(tmp_path / "ddp", *args, "--devices", "2")
    tower = train_here(tmp_path / "tower", *args, "--devices", "2", "--strategy", "tower")
    assert (single["strategy"], ddp["strategy"], tower["strategy"]) == ("ddp", "ddp", "tower")
    assert tower["world_size"] == 2
    w = weights(tmp_path / "single")
    assert max_abs_diff(w, weights(tmp_path / "ddp")) < 3e-6  # measured 2.2e-8
    assert max_abs_diff(w, weights(tmp_path / "tower")) < 3e-6


def test_tower_gradient_is_the_global_batch_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tower = Tower(model, [torch.device("cpu")] * 3)
    torch.nn.functional.cross_entropy(tower(x), y).backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-7)
    with pytest.raises(ValueError, match="does not split evenly over 3 towers"):
        tower(torch.randn(10, 6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("param_device", ["cpu", "cuda:0"])
def test_tower_on_gpus(tmp_path: Path, param_device: str) -> None:
    n = torch.cuda.device_count()
    args = ("--steps", "10", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", str(32 * n))
    train_here(tmp_path / "single", *args, "--devices", "1", "--accelerator", "cpu")
    tower = train_here(tmp_path / "tower", *args, "--accelerator", "gpu", "--devices", str(n), "--strategy", "tower",
                  "--param-device", param_device)
    assert tower["world_size"] == n
    assert max_abs_diff(weights(tmp_path / "single"), weights(tmp_path / "tower")) < 1e-3
