"""What a run is made of, built from its configuration (or the user's Parts): the model, the optimizer,
the learning-rate schedule, the weight average, and the batch transforms."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig
from ..core.errors import UserError
from ..core.import_path import is_hf_folder, is_import_path
from ..data import Splits
from ..data.transforms import Augment, BatchPipeline, TensorPipeline
from ..models import build_model, convolutional, input_size
from ..models.imported import call_factory
from ..optimization.optim import make_optimizer, make_scheduler
from .adapt import read_by_logits
from .initial import Initial, weights_on_meta
from .lora import adapted
from .parts import Parts
from .pretrained import Pretrained


def make_model(cfg: TrainConfig, data: Splits | None, parts: Parts | None = None) -> nn.Module:
    """The user's network (from their factory) or the registry's, on the CPU, with low-rank adapters where --lora
    asks (lora.py); the registry's needs `data` (its shapes: `Splits.shaped_like` makes empty splits of a
    checkpoint's)."""
    return adapted(_network(cfg, data, parts), cfg)


def _network(cfg: TrainConfig, data: Splits | None, parts: Parts | None = None) -> nn.Module:
    if parts is not None and parts.model is not None:  # the same rule as a factory named by import path
        if not data.images:
            return read_by_logits(call_factory(parts.model, None, None, data.num_classes or None,
                                               input_shape=data.input_shape, num_outputs=data.num_outputs))
        return read_by_logits(call_factory(parts.model, data.channels, data.image_size, data.num_classes,
                                           input_shape=data.input_shape, num_outputs=data.num_outputs))
    if not data.images:
        return _tensor_model(cfg, data)
    return build_model(cfg.model, data.channels, input_size(cfg.model, data.image_size), data.num_classes,
                       width=cfg.width, depth=cfg.depth, activation=cfg.activation, dropout=cfg.dropout,
                       filters=cfg.filters, kernel=cfg.kernel)


def make_empty(cfg: TrainConfig, data: Splits, parts: Parts | None) -> tuple[nn.Module, Any, str]:
    """The model built without memory for its weights (the meta device) and its initial weights: drawn module by
    module from the seed as each worker takes its part (initial.py), or read so from --init-from (pretrained.py);
    or, where its modules cannot draw their own, the model built whole on the CPU from the seed, as make_model
    builds it, None, and why."""
    if cfg.init_from:
        return pretrained_model(cfg, data, parts)
    try:
        with weights_on_meta() as writes:  # (the adapters after: PEFT writes their values as it makes them)
            model = _network(cfg, data, parts)
        model = adapted(model, cfg)
        initial, why = Initial.of(model, cfg.seed, writes.why)
    except Exception as e:  # noqa: BLE001 (a network of yours that computes with its weights as it is built)
        initial, why = None, f"it cannot be built on the meta device ({type(e).__name__}: {e})"
    if initial is not None:
        return model, initial, ""
    torch.manual_seed(cfg.seed)
    return make_model(cfg, data, parts), None, why


def pretrained_model(cfg: TrainConfig, data: Splits, parts: Parts | None) -> tuple[nn.Module, Pretrained, str]:
    """The model on the meta device and the weights --init-from names, checked against it (UserError)."""
    source = Pretrained.of(cfg.init_from)
    try:
        with weights_on_meta():
            model = _network(cfg, data, parts)
        model = adapted(model, cfg)
    except UserError:
        raise
    except Exception:  # noqa: BLE001 (a network that computes with its weights as it is built: whole, then read)
        model = make_model(cfg, data, parts)
    if cfg.lora:  # the adapters' own weights: drawn from the seed (the rest is read)
        source.adapters = Initial(model, cfg.seed)
    source.check(model)
    return model, source, ""


def initial_model(cfg: TrainConfig, data: Splits, parts: Parts | None = None) -> nn.Module:
    """The model whole on the CPU, with the initial weights that a run of `cfg` starts from on one device and on
    every layout."""
    torch.manual_seed(cfg.seed)
    model, initial, _ = make_empty(cfg, data, parts)
    return model if initial is None else initial.fill(model, torch.device("cpu"))


class Reshape(nn.Module):
    """A batch's rows reshaped to one example's target shape (a regression's () or K x L targets)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a copy, not a view: FSDP warns of a root module whose output is a view (an in-place op on it would
        # skip its hooks); the copy is one number an example
        return x.reshape(len(x), *self.shape).clone()

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


def _tensor_model(cfg: TrainConfig, data: Splits) -> nn.Module:
    """The registry's network for data that is not images: the MLP, over the flattened input (any width),
    with an output per class, or per target element in the targets' shape."""
    if is_hf_folder(cfg.model):  # a Hugging Face model folder's config
        from ..models.hf import check_packable, from_folder

        model = from_folder(cfg.model)
        if cfg.pack:
            check_packable(model, cfg.model)
        return read_by_logits(model)
    if is_import_path(cfg.model):  # a factory by its path, called as fit's are
        from ..models.imported import resolve

        return read_by_logits(call_factory(resolve(cfg.model), None, None, data.num_classes or None,
                                           input_shape=data.input_shape, num_outputs=data.num_outputs))
    check_tensor_model(cfg, data)
    if cfg.model == "gru":
        return _gru(cfg, data)
    if cfg.model == "gpt":
        from ..models.gpt import GPT

        return GPT(data.vocabulary, data.input_shape[0], cfg.width, cfg.depth, cfg.heads, cfg.dropout or 0.0)
    net = build_model("mlp", math.prod(data.input_shape), 1, data.num_outputs, width=cfg.width, depth=cfg.depth,
                      activation=cfg.activation, dropout=cfg.dropout)
    if not data.input_shape:  # one number an example: a column of width 1 for the first layer
        net.insert(0, Reshape((1,)))
    if not data.classification:
        net.append(Reshape(data.target_shape))
    return net


def check_tensor_model(cfg: TrainConfig, data: Splits, every_id: bool = False) -> None:
    """The registry's network against data that is not images: mlp over float features, gru over token ids.
    `every_id`: also read every token id for a negative one (once, before the run: a pass over the data)."""
    if cfg.model == "gpt":
        _check_gpt(data)
    elif cfg.model == "gru":
        if data.train[0].is_floating_point() or len(data.input_shape) != 1:
            raise UserError(f"model 'gru' reads token ids, integers N x L; these inputs are {data.train[0].dtype}, "
                            f"{data.input_shape} an example: use model 'mlp' for features")
        if every_id and any(len(t) and int(t.min()) < 0 for t in (data.train[0], data.val[0], data.test[0])):
            raise UserError("model 'gru' reads token ids 0..V-1, and some inputs are negative: renumber them from 0")
    elif cfg.model != "mlp":
        raise UserError(f"model '{cfg.model}' takes images; this data is tensors of shape {data.input_shape} an "
                        "example: use model 'mlp' (features), 'gru' (token ids) or a network of your own "
                        "(paratrain.fit(model=make_net, ...))")
    elif data.sequence:
        raise UserError(f"model 'mlp' gives numbers, and these targets are integers of shape {data.target_shape} an "
                        "example (token ids, judged by the cross-entropy over every position): use model 'gpt' or a "
                        "network of your own that gives N x T x V scores, or give float targets")
    elif not data.train[0].dtype.is_floating_point:
        raise UserError(f"model 'mlp' takes float inputs; these are {data.train[0].dtype}: for features, give them "
                        "as floats; for token ids, use model 'gru' or a network of your own that embeds them")


def _check_gpt(data: Splits) -> None:
    x, shape = data.train[0], data.input_shape
    if x.is_floating_point() or x.dtype == torch.uint8 or len(shape) != 1:
        raise UserError(f"model 'gpt' reads token ids, integers N x T; these inputs are {x.dtype}, {shape} an "
                        "example: give it --dataset text, or token ids")
    if not data.sequence or data.target_shape != shape:
        raise UserError(f"model 'gpt' predicts a token at every position: its targets are token ids N x T like its "
                        f"inputs (the next tokens); these are {data.train[1].dtype}, {data.target_shape} an example "
                        "(for one class a sequence, use model 'gru')")


def _gru(cfg: TrainConfig, data: Splits) -> nn.Module:
    """The registry's sequence model: token ids N x L in, a score per class (or the targets' numbers) out."""
    from ..models.gru import GRUNet

    net = GRUNet(data.vocabulary, data.num_outputs, cfg.width, cfg.depth, cfg.dropout or 0.0)
    if not data.classification:
        net.append(Reshape(data.target_shape))
    return net


def memory_format(cfg: TrainConfig, channels_last: bool) -> torch.memory_format:
    """The layout of the model's weights and input batches. Channels-last (N x H x W x C in memory) is what
    oneDNN's CPU convolutions are fastest on: one training step on one thread was 1.2x (LeNet-5), 1.6x
    (mnist-fast-net) and 1.4x (cifar10-fast-net) as fast as in the default layout. auto: channels-last for
    the registry's convolutional networks where the run's layout allows it (`channels_last`, its strategy's: a
    pipeline sends activations between processes, which wants the default layout)."""
    if cfg.memory_format == "auto":
        wanted = convolutional(cfg.model) and channels_last
    else:
        wanted = cfg.memory_format == "channels_last"
    return torch.channels_last if wanted else torch.contiguous_format


def make_batch_transforms(cfg: TrainConfig, data: Splits, device: torch.device,
                          channels_last: bool = False) -> BatchPipeline | TensorPipeline:
    """Normalisation and the training augmentation, applied to whole batches on the device (images; other
    tensors go to the network as they are); `channels_last`: as memory_format takes it."""
    if not data.images:
        if not cfg.standardize:
            return TensorPipeline()
        shape = data.input_shape
        mean, std = (torch.tensor(v, dtype=torch.float32, device=device).reshape(shape) for v in (data.mean, data.std))
        return TensorPipeline(mean, std)
    augment = Augment(cfg.random_crop, cfg.crop_padding, cfg.hflip, cfg.brightness, cfg.contrast)
    return BatchPipeline(data.mean, data.std, input_size(cfg.model, data.image_size), device, augment,
                         memory_format(cfg, channels_last))


def optimizer_parts(cfg: TrainConfig, module: nn.Module, parts: Parts, total_steps: int,
                    per_epoch: int, device: torch.device) -> tuple[torch.optim.Optimizer, Any, Any]:
    """The optimizer over `module` (the user's factory or the configuration's), its learning-rate schedule
    and the gradient scaler (16-mixed only). The weight average (--ema) is the strategy's (Strategy.average)."""
    optimizer = (parts.optimizer or partial(make_optimizer, cfg))(module.parameters())
    scheduler = make_scheduler(cfg, optimizer, total_steps, per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "16-mixed")
    return optimizer, scheduler, scaler
