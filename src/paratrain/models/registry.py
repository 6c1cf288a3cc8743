"""Model registry: name -> builder and the input size the architecture was drawn for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..core.errors import UserError
from ..core.import_path import is_import_path, is_own_network
from ..core.tracebacks import failed
from .airnet import AirNet
from .cifar10_net import Cifar10Net
from .convnet import ConvNet
from .lenet5 import LeNet5
from .mlp import MLP
from .mnist_fast_net import MnistFastNet
from .mnist_net import MnistNet


@dataclass(frozen=True)
class ModelSpec:
    builder: Callable[..., nn.Module] | None
    # Square input side the layers were sized for; the data pipeline pads or centre-crops to it.
    # None: any size (the MLP flattens whatever it gets).
    input_size: int | None
    default_dropout: float | None = None
    channels: int = 1  # of the images the model was drawn for (shapes the synthetic dataset)
    # its layers take any memory layout (build.memory_format's channels-last); a user's network may .view() its
    # activations, which a channels-last tensor refuses
    convolutional: bool = True
    reads: tuple[str, ...] = ()  # the model options (MODEL_OPTIONS) its builder reads


# The options that shape a network; each model reads some of them (ModelSpec.reads), a network of the user's none
MODEL_OPTIONS = ("width", "depth", "heads", "activation", "dropout", "filters", "kernel")
READS = {"gru": ("width", "depth", "dropout"), "gpt": ("width", "depth", "heads", "dropout")}


REGISTRY: dict[str, ModelSpec] = {
    "lenet5": ModelSpec(lambda c, k, o: LeNet5(c, k), 32),
    "convnet": ModelSpec(lambda c, k, o: ConvNet(c, k, o["dropout"], o["filters"], o["kernel"]), 28, 0.25,
                         reads=("dropout", "filters", "kernel")),
    "mnist-net": ModelSpec(lambda c, k, o: MnistNet(c, k, o["dropout"]), 28, 0.5, reads=("dropout",)),
    "cifar10-net": ModelSpec(lambda c, k, o: Cifar10Net(c, k), 24, channels=3),
    "mnist-fast-net": ModelSpec(lambda c, k, o: MnistFastNet(c, k), 28),
    "cifar10-fast-net": ModelSpec(lambda c, k, o: AirNet(c, k, o["filters"]), 32, channels=3, reads=("filters",)),
    "mlp": ModelSpec(lambda c, k, o: MLP(o["in_features"], k, o["width"], o["depth"], o["activation"],
                                         o["dropout"]), None, 0.0, convolutional=False,
                     reads=("width", "depth", "activation", "dropout")),
}
# the sequence model over token ids (tensors, not images, so not in REGISTRY): build._tensor_model builds it
TOKENS = ModelSpec(None, None, convolutional=False)
# A network of the user's own, given to paratrain.fit as a factory: no builder here, any input size.
CUSTOM = ModelSpec(None, None, convolutional=False)


def _spec(name: str) -> ModelSpec:
    if name == "custom" or is_own_network(name):  # a network of the user's: any input size
        return CUSTOM
    if name in ("gru", "gpt"):
        return TOKENS
    if name not in REGISTRY:
        raise UserError(f"unknown model '{name}'; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def options_unread(name: str) -> tuple[str, ...]:
    """The model options that model `name` does not read (none for a network of the user's: its factory may be
    given them in a later version, and they cost nothing to keep)."""
    if name == "custom" or is_own_network(name) or name not in (*REGISTRY, *READS):
        return ()
    reads = READS.get(name) or REGISTRY[name].reads
    return tuple(option for option in MODEL_OPTIONS if option not in reads)


def native_channels(name: str) -> int:
    """Colour channels of the dataset the model was drawn for: 3 for the CIFAR-10 net, else 1."""
    return _spec(name).channels


def convolutional(name: str) -> bool:
    """A registry network of convolutions, whose layers take any memory layout."""
    return _spec(name).convolutional


def input_size(name: str, data_size: int) -> int:
    """Side of the square images the model is fed: its own size, or the data's for size-free models."""
    return _spec(name).input_size or data_size


def build_imported(name: str, channels: int, image_size: int, num_classes: int) -> nn.Module:
    """The network that an import path's factory builds for the data's shapes."""
    from .imported import call_factory, resolve

    factory = resolve(name)
    try:
        net = call_factory(factory, channels, image_size, num_classes)
    except Exception as e:  # noqa: BLE001 (the user's code may raise anything)
        raise failed(f"--model {name}: the factory failed", e) from None
    if not isinstance(net, nn.Module):
        raise UserError(f"--model {name}: the factory returned a {type(net).__name__}, not an nn.Module")
    return net


def build_model(name: str, in_channels: int, image_size: int, num_classes: int, *, width: int = 512,
                depth: int = 2, activation: str = "relu", dropout: float | None = None, filters: int = 64,
                kernel: int = 5) -> nn.Module:
    """Build a registry model on the CPU; the caller moves it to its device."""
    if is_import_path(name):
        return build_imported(name, in_channels, image_size, num_classes)
    spec = _spec(name)
    if name in ("gru", "gpt"):
        raise UserError(f"model '{name}' reads token ids (integers, N x L), not images: give it "
                        f"{'--dataset text, ' if name == 'gpt' else ''}--dataset tensors or csv, or tensors to "
                        "paratrain.fit")
    if spec.builder is None:
        raise UserError("model 'custom' is a network of your own: give its factory to paratrain.fit(model=...); "
                        "from the command line choose a registry model")
    opts = {"width": width, "depth": depth, "activation": activation,
            "dropout": spec.default_dropout if dropout is None else dropout, "filters": filters, "kernel": kernel,
            "in_features": in_channels * image_size * image_size}
    return spec.builder(in_channels, num_classes, opts)
