import pytest
import torch

from paratrain.core.errors import UserError
from paratrain.models import REGISTRY, build_model, input_size
from paratrain.models.layers import BandedLRN


@pytest.mark.parametrize("name,channels,data_size", [
    ("lenet5", 1, 28), ("convnet", 1, 28), ("mnist-net", 1, 28), ("cifar10-net", 3, 32), ("mlp", 1, 28),
    ("mlp", 3, 32),
])
def test_forward_shapes(name: str, channels: int, data_size: int) -> None:
    side = input_size(name, data_size)
    model = build_model(name, channels, side, 10)
    assert model(torch.zeros(5, channels, side, side)).shape == (5, 10)


def test_input_sizes_follow_the_classic_papers() -> None:
    assert input_size("lenet5", 28) == 32  # MNIST padded by 2
    assert input_size("cifar10-net", 32) == 24  # the tutorial's 24x24 crops
    assert input_size("mnist-net", 28) == 28
    assert input_size("mlp", 17) == 17


def test_lenet5_layers() -> None:
    model = build_model("lenet5", 1, 32, 10)
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(400, 120), (120, 84), (84, 10)]
    assert sum(p.numel() for p in model.parameters()) == 61_706


def test_cifar10_net_matches_the_tutorial() -> None:
    model = build_model("cifar10-net", 3, 24, 10)
    lrn = [m for m in model if isinstance(m, BandedLRN)]
    assert len(lrn) == 2 and lrn[0].size == 9 and lrn[0].alpha == pytest.approx(0.001)
    linear = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(2304, 384), (384, 192), (192, 10)]


def test_mlp_options() -> None:
    model = build_model("mlp", 1, 28, 10, width=64, depth=3, activation="tanh", dropout=0.1)
    assert sum(isinstance(m, torch.nn.Linear) for m in model) == 4
    assert sum(isinstance(m, torch.nn.Tanh) for m in model) == 3
    assert sum(isinstance(m, torch.nn.Dropout) for m in model) == 3


def test_models_stay_on_the_cpu_until_moved() -> None:
    for name in REGISTRY:
        side = input_size(name, 28)
        assert all(p.device.type == "cpu" for p in build_model(name, 1, side, 10).parameters())


def test_unknown_model() -> None:
    with pytest.raises(UserError, match="unknown model 'resnet'"):
        build_model("resnet", 1, 28, 10)


@pytest.mark.parametrize("size", [9, 4, 5])
def test_banded_lrn_is_pytorchs_lrn(size: int) -> None:
    ref, ours = torch.nn.LocalResponseNorm(size, 0.001, 0.75, 1.0), BandedLRN(16, size, 0.001, 0.75, 1.0)
    x = (torch.randn(4, 16, 5, 5, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    a, b = ref(x), ours(x2)
    a.pow(2).sum().backward()
    b.pow(2).sum().backward()
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(x.grad, x2.grad, atol=1e-4)
    assert not BandedLRN(8, 3).state_dict()  # nothing new in checkpoints
