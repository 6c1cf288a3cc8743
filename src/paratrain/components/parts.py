"""What a user brings in place of the configuration's: a model factory, an optimizer factory, a loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.tracebacks import name_of


def _rebuild(blob: bytes, files: dict[tuple[str, int], str] | None = None) -> Parts:
    import pickle

    parts = Parts(*pickle.loads(blob))
    if files:
        seen: set[int] = set()
        for obj in (parts.model, parts.optimizer, parts.loss, *(parts.metrics or {}).values()):
            _restore_files(obj, files, seen)
    return parts


# cloudpickle (3.1.3 on) names the file of every code object it sends by value "<dynamic-code>", so a
# worker's traceback lost the user's file and line ("at mine.py:13 in forward"); the sender records where
# each of its main script's functions was defined, and the worker puts the names back.
DYNAMIC = "<dynamic-code>"


def _main_files() -> dict[tuple[str, int], str]:
    """(qualified name, first line) -> file of the code objects defined in the main script."""
    import sys
    import types

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return {}
    found: dict[tuple[str, int], str] = {}

    def add(code: types.CodeType) -> None:
        if code.co_filename == path:
            found[(code.co_qualname, code.co_firstlineno)] = path
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    add(const)

    for value in list(vars(main).values()):
        for fn in _functions_of(value):
            add(fn.__code__)
    return found


def _functions_of(obj: Any) -> list[Any]:
    """The plain functions of a function or a class (its methods, static and class methods, properties)."""
    import types

    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, type):
        out = []
        for attr in vars(obj).values():
            attr = getattr(attr, "__func__", attr)
            if isinstance(attr, property):
                out += [f for f in (attr.fget, attr.fset) if isinstance(f, types.FunctionType)]
            elif isinstance(attr, types.FunctionType):
                out.append(attr)
        return out
    return []


def _restore_files(obj: Any, files: dict[tuple[str, int], str], seen: set[int]) -> None:
    import types

    def fixed(code: types.CodeType) -> types.CodeType:
        consts = tuple(fixed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        name = files.get((code.co_qualname, code.co_firstlineno), code.co_filename)
        return code.replace(co_filename=name if code.co_filename == DYNAMIC else code.co_filename, co_consts=consts)

    if id(obj) in seen or not isinstance(obj, (type, types.FunctionType)):
        return
    seen.add(id(obj))
    sent = [fn for fn in _functions_of(obj) if fn.__code__.co_filename == DYNAMIC]  # by value, not a library's
    for fn in sent:
        fn.__code__ = fixed(fn.__code__)
        for value in list(fn.__globals__.values()):  # the classes and helpers a factory uses, sent with it
            _restore_files(value, files, seen)


@dataclass(frozen=True)
class Parts:
    """`model()` builds the network on the CPU (every worker calls it after seeding, so every replica starts
    the same); `optimizer(params)` makes the optimizer; `loss(logits, targets)` is the batch mean. None:
    the configuration's model, optimizer, or cross-entropy."""

    model: Callable[[], nn.Module] | None = None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    record: dict[str, Any] | None = None  # what they are, in words (parts_check.check_and_describe): the record
    metrics: dict[str, Any] | None = None  # name -> a torchmetrics object or a function (metrics.py)

    def model_name(self) -> str:
        return name_of(self.model)

    def __reduce__(self) -> tuple[Any, ...]:
        # Spawned workers receive their arguments pickled. cloudpickle sends a lambda or a local function
        # by value (plain pickle cannot), and a module-level one by reference, as pickle would.
        import cloudpickle

        sent = (self.model, self.optimizer, self.loss, self.record, self.metrics)
        return _rebuild, (cloudpickle.dumps(sent), _main_files())
