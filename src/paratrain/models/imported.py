"""A user's network by import path: `package.module:factory` or `path/to/file.py:factory`.

The path is a model name like "lenet5": config.yaml records it, and every worker (spawned or under
torchrun), `--resume`, `paratrain eval`, `load_model` and `paratrain search` resolve it the same way, here.
A factory gets whichever of `channels`, `image_size` (images only), `num_classes` (class targets only),
`input_shape` and `num_outputs` it names (a factory that names none of them but takes **kwargs, as
torchvision's models do, gets `num_classes`); the same rule holds for the factories given to
`paratrain.fit(model=...)`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..core.import_path import is_file
from ..core.tracebacks import failed

SHAPE_ARGUMENTS = ("channels", "image_size", "num_classes")


def resolve(name: str) -> Callable[..., Any]:
    """The factory an import path names; a missing file, module or name is one line."""
    head, _, tail = name.rpartition(":")
    module = _load_file(head) if is_file(head) else _import_module(head)
    factory = getattr(module, tail, None)
    if factory is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserError(f"--model {name}: {head} has no '{tail}'" +
                        (f"; it defines: {', '.join(found[:8])}" if found else ""))
    if not callable(factory):
        raise UserError(f"--model {name}: '{tail}' is {_a(type(factory).__name__)}, not a class or function that "
                        "builds the network")
    return factory


def _load_file(head: str) -> Any:
    path = Path(head).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"--model: the file {path} does not exist; give path/to/file.py:factory")
    # One module name per file, so a second resolve in this process (the check, then a worker's build in an
    # in-process run) reuses it, and two files of the same name do not collide.
    key = "paratrain_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise UserError(f"--model: {path} is not a Python file; give path/to/file.py:factory")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before running it: a dataclass or pickle in it looks itself up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the user's file may raise anything as it is imported)
        del sys.modules[key]
        raise failed(f"--model: importing {path} failed", e) from None
    return module


def _import_module(head: str) -> Any:
    # As `python -m` and uvicorn do: the current folder is where a user's own package is looked for.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(head)
    except ModuleNotFoundError as e:
        if e.name and head.startswith(e.name):
            raise UserError(f"--model: no module named '{e.name}' (looked in the current folder and the installed "
                            "packages); give package.module:factory or path/to/file.py:factory") from None
        raise failed(f"--model: importing {head} failed", e) from None
    except Exception as e:  # noqa: BLE001
        raise failed(f"--model: importing {head} failed", e) from None


IMAGE_ONLY = ("channels", "image_size")  # what a factory is given only where the data is images


def call_factory(factory: Callable[..., Any], channels: int | None, image_size: int | None, num_classes: int,
                 **shapes: Any) -> Any:
    """Call a network factory with the data's shapes it asks for by name: `channels`, `image_size` (images),
    `num_classes`, and in `shapes` `input_shape` (one example's) and `num_outputs` (what the last layer gives
    an example). Data that is not images has no channels or image size: a factory that asks is told so."""
    given = {"channels": channels, "image_size": image_size, "num_classes": num_classes, **shapes}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C extension without a signature: call it bare
        return factory()
    required = [k for k, p in params.items()
                if p.default is inspect.Parameter.empty and k in given and given[k] is None]
    if "num_classes" in required and "channels" not in required and "image_size" not in required:
        raise UserError("your model factory asks for num_classes, and these targets are not class indices: take "
                        "num_outputs (what the last layer gives an example) instead")
    asked = [k for k in IMAGE_ONLY if k in required]
    if asked:
        raise UserError(f"your model factory asks for {' and '.join(asked)}, which only images have; this data is "
                        f"tensors of shape {tuple(shapes.get('input_shape') or ())} an example: take input_shape "
                        "(and num_outputs, num_classes) instead")
    named = {k: v for k, v in given.items() if k in params and v is not None}
    if not named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        # torchvision's models (resnet18(**kwargs)) hand kwargs on to the network's class, which takes
        # num_classes but not the data's channels or size
        return factory(num_classes=num_classes) if num_classes else factory()
    return factory(**named)


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
