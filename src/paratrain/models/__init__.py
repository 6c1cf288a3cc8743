"""Plain nn.Module classes and a registry. A model never picks its device: the caller moves it."""

from .registry import REGISTRY, ModelSpec, build_model, convolutional, input_size, native_channels, options_unread

__all__ = ["REGISTRY", "ModelSpec", "build_model", "convolutional", "input_size", "native_channels", "options_unread"]
