"""paratrain: train image classifiers with data, model and hyper-parameter parallelism, and measure it.

The Python API; the `paratrain` command is one client of it:
    fit(make_net, data, TrainConfig(...), optimizer=..., loss=...) -> the run's summary
    evaluate(run_dir, ...)  -> test accuracy and loss of a run's last checkpoint
    load_model(run_dir, ...) -> the trained network
    load_classifier(run_dir, ...) -> the network with its input preparation: .predict(images), .transform(images)
    load_predictor(run_dir, ...) -> the same for any run: a Classifier (images), or a Predictor (tensors)
    load_generator(run_dir, ...) -> a language model with its tokenizer: .generate(prompt, tokens=40, ...)
    Stopped                  -> what fit raises when a signal (Ctrl-C, SIGTERM) stopped the run after its checkpoint
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Classifier", "Predictor", "Splits", "Stopped", "TextGenerator", "TrainConfig", "UserError", "evaluate",
           "fit", "load_classifier", "load_generator", "load_model", "load_predictor"]

_WHERE = {"fit": "api", "evaluate": "api", "load_model": "inference.trained",
          "load_classifier": "inference.trained", "load_predictor": "inference.trained",
          "Classifier": "inference.predictor", "Predictor": "inference.predictor",
          "TrainConfig": "config", "Splits": "data", "UserError": "core.errors",
          "load_generator": "inference.generate", "TextGenerator": "inference.generate", "Stopped": "runtime.interrupt"}


def __getattr__(name: str) -> Any:
    # Imported on first use: `paratrain --help` and its one-line errors need no torch (about 1.5 s).
    if name not in _WHERE:
        raise AttributeError(f"module 'paratrain' has no attribute '{name}'")
    from importlib import import_module

    return getattr(import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    # the names imported on first use are this module's too (dir() and tab completion list them)
    return sorted({*__all__, "__version__"})
