"""The optional dependencies (pyproject's extras): whether one is installed, and the one line that says how to
install it. A search needs Optuna (`paratrain[search]`), plots matplotlib (`[plots]`), TensorBoard's event
files the tensorboard package (`[tensorboard]`), a tokenizer other than bytes tiktoken or tokenizers
(`[text]`), an
experiment tracker its client (`[mlflow]`, `[wandb]`); `[all]` brings the rest (`[transformers]` is a network's own
dependency: it is not in all)."""

from __future__ import annotations

from importlib.util import find_spec

from .errors import UserError

EXTRA = {"optuna": "search", "sklearn": "search", "matplotlib": "plots", "tensorboard": "tensorboard",
         "psycopg": "postgres", "tiktoken": "text", "tokenizers": "text", "torchao": "float8",
         "mlflow": "mlflow", "wandb": "wandb", "transformers": "transformers",
         "safetensors": "transformers", "datasets": "finetune", "peft": "finetune"}

NOT_IN_ALL = ("float8", "mlflow", "wandb", "transformers")


def installed(module: str) -> bool:
    """Whether `module` can be imported (found without importing it: no cost at start-up)."""
    return find_spec(module) is not None


def how_to_install(module: str) -> str:
    extra = EXTRA[module]
    # torchao follows torch's releases closely, and a tracker's client is a team's choice: installed on its own
    return f"pip install 'paratrain[{extra}]'" + ("" if extra in NOT_IN_ALL else " (or 'paratrain[all]')")


def require(module: str, what: str) -> None:
    """Raise the one line that says what to install, where `module` is missing."""
    if not installed(module):
        raise UserError(f"{what} needs {module}, which is not installed: {how_to_install(module)}")
