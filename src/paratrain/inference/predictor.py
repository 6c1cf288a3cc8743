"""A trained network as a classifier of new images: the input preparation it was trained with, built in.

    clf = paratrain.load_classifier("runs/lenet5-mnist-...")
    clf.predict(images)                      # class indices; images as they come (uint8 tensors, PIL, files)
    clf.predict(images, probabilities=True)  # and the softmax probabilities
    clf.transform(images)                    # the float batch the network takes, for your own loop

The network was trained on images scaled to 0..1 and normalised with the training set's per-channel mean
and std (saved in the checkpoint), padded or centre-cropped to its input size: raw pixels would be misread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import UserError
from ..data.transforms import BatchPipeline

_DIGITS = tuple(str(i) for i in range(10))
CLASS_NAMES = {"digits": _DIGITS, "mnist": _DIGITS,
               "fashion-mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                                 "Bag", "Ankle boot"),
               "kmnist": ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"),
               "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")}


class Classifier:
    """A trained network (on the CPU, in eval mode) and the transform of its training data."""

    def __init__(self, model: nn.Module, pipeline: BatchPipeline, channels: int, image_size: int,
                 classes: tuple[str, ...] | None = None, flip: bool = False) -> None:
        self.model = model.eval()
        self.flip = flip  # the run was judged on each image and its mirror image (--test-flip): so is predict
        self.pipeline = pipeline
        self.channels = channels  # what the training images were: the model's input before the transform
        self.image_size = image_size
        self.classes = classes  # class names where the dataset has them (index i is classes[i])

    def transform(self, images: Any) -> torch.Tensor:
        """Images as they come -> the normalised float batch N x C x S x S the network takes.

        images: an image file's path or a PIL image (converted to the model's grey or RGB); a uint8 tensor
        (0..255) or a float tensor (0..1) of N x C x H x W, C x H x W or H x W, or N x H x W for a one-channel
        model; a NumPy array as image libraries give them (H x W, H x W x C, N x H x W x C); or a list of
        such. Images of another size are resized (the shorter side) and centre-cropped to the training
        images' size."""
        return self.pipeline.eval(self._batch(images))

    @torch.no_grad()
    def predict(self, images: Any, probabilities: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The class index of each image (a tensor of N), and with `probabilities` also the N x K softmax."""
        x = self.transform(images)
        logits = self.model(x).float()
        if self.flip:
            logits = (logits + self.model(x.flip(3)).float()) / 2
        labels = logits.argmax(1)
        return (labels, logits.softmax(1)) if probabilities else labels

    __call__ = predict

    # ---- images as they come -> one uint8 or float batch of the training images' shape ----

    def _batch(self, images: Any) -> torch.Tensor:
        if isinstance(images, list | tuple):
            if not images:
                raise UserError("predict: no images given")
            return torch.stack([self._fit(self._one(x)) for x in images])
        x = self._tensor(images)
        if x.dim() == 2:
            x = x[None, None]
        elif x.dim() == 3:  # one C x H x W image, or N x H x W one-channel images
            x = x[None] if x.shape[0] in (1, 3) and x.shape[0] == self.channels else x[:, None]
        elif x.dim() != 4:
            raise UserError(f"predict: images must be N x C x H x W, C x H x W or H x W; got {tuple(x.shape)}")
        if not len(x):
            raise UserError("predict: no images given")
        return self._fit(x)

    def _one(self, image: Any) -> torch.Tensor:
        x = self._tensor(image)
        if x.dim() == 2:
            return x[None]
        if x.dim() == 3:
            return x
        raise UserError(f"predict: each image of a list must be C x H x W or H x W; got {tuple(x.shape)}")

    def _tensor(self, images: Any) -> torch.Tensor:
        if isinstance(images, str | Path):  # an image file
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(images) as image:
                    return self._tensor(image.copy())
            except (OSError, UnidentifiedImageError) as e:
                raise UserError(f"predict: cannot read the image {images} ({e}); pass an image file") from None
        if isinstance(images, torch.Tensor):
            x = images.detach().cpu()
        elif hasattr(images, "convert") and hasattr(images, "mode"):  # a PIL image
            from torchvision.transforms.functional import pil_to_tensor

            return pil_to_tensor(images.convert("L" if self.channels == 1 else "RGB"))
        elif type(images).__module__ == "numpy":
            x = torch.from_numpy(images.copy())
            if x.dim() >= 3 and x.shape[-1] in (1, 3, 4):  # channels last, as image libraries keep them
                x = x.movedim(-1, -3)[..., :3, :, :]
        else:
            raise UserError("predict: images must be tensors, NumPy arrays, PIL images or image files, not "
                            f"{type(images).__name__}")
        if x.dtype != torch.uint8 and not x.is_floating_point():
            raise UserError(f"predict: images must be uint8 (0..255) or float (0..1), not {x.dtype}")
        return x

    def _fit(self, x: torch.Tensor) -> torch.Tensor:
        """Channels and size as the training images had them."""
        from torchvision.transforms import functional as TF

        c = x.shape[-3]
        if c != self.channels:
            if c == 1 and self.channels == 3:
                x = x.expand(*x.shape[:-3], 3, *x.shape[-2:])
            elif c == 3 and self.channels == 1:
                x = TF.rgb_to_grayscale(x)
            else:
                raise UserError(f"predict: the model takes {self.channels}-channel images; these have {c}")
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = TF.center_crop(TF.resize(x, [self.image_size], antialias=True), [self.image_size])
        return x



class Predictor:
    """A network trained on tensors (kind "tensors"), on the CPU in eval mode, with its input preparation
    (--standardize's statistics, where the run had them): `predict(inputs)` gives class indices where the
    targets were classes (and the probabilities on request), else the network's outputs."""

    def __init__(self, model: nn.Module, pipeline: Any, input_shape: tuple[int, ...], input_float: bool,
                 classes: int, names: tuple[str, ...] | None = None, vocabulary: int = 0) -> None:
        self.model = model.eval()
        self.pipeline = pipeline
        self.input_shape = input_shape  # one example's
        self.input_float = input_float
        self.num_classes = classes  # 0: the targets were numbers
        self.classes = list(names) if names else None  # the class names, where the data had them (a CSV's)
        self.vocabulary = vocabulary  # token ids: the embedding's size

    def transform(self, inputs: Any) -> torch.Tensor:
        """The batch the network takes: a batch of examples (or one), as a tensor or a NumPy array."""
        x = torch.as_tensor(inputs)
        if tuple(x.shape) == self.input_shape:
            x = x.unsqueeze(0)  # one example
        if tuple(x.shape[1:]) != self.input_shape:
            raise UserError(f"the network takes examples of shape {self.input_shape}; got {tuple(x.shape)}")
        if self.input_float and not x.is_floating_point() and x.dtype != torch.uint8:  # uint8: bytes, as in training
            raise UserError(f"the network was trained on float inputs; got {x.dtype}")
        if not self.input_float and x.is_floating_point():
            raise UserError(f"the network was trained on integer inputs (token ids); got {x.dtype}")
        if self.vocabulary and x.numel() and not 0 <= int(x.min()) <= int(x.max()) < self.vocabulary:
            raise UserError(f"the network knows token ids 0..{self.vocabulary - 1}; these reach "
                            f"{int(x.min())}..{int(x.max())}")
        return self.pipeline.eval(x.float() if self.input_float else x.long())

    def predict(self, inputs: Any, probabilities: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = self.model(self.transform(inputs))
        if not self.num_classes:
            if probabilities:
                raise UserError("probabilities are for class targets; this network's targets were numbers")
            return out
        probs = out.softmax(1)
        return (probs.argmax(1), probs) if probabilities else probs.argmax(1)
