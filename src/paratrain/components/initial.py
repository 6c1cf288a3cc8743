"""A model's initial weights, drawn one module at a time: the model is built without memory for its weights (on
the meta device; its buffers, small, are real), laid out over the workers as it is (cut, split, sharded), and then
each worker draws the weights of one module after another, keeping only its own part of each. No worker holds
more than its part and one module whole.

Module P draws its weights by its own `reset_parameters`, from a generator seeded by the run's seed and P's name
alone, so that any worker can draw any module without the others, in any order: one device and every layout start
from the same weights, to the bit. A network whose modules cannot draw their own weights (a module that holds
weights without `reset_parameters`, or a factory that loads weights into the network) is built whole, as it draws
itself, on every layout alike (`Initial.of` returns None for it, with the reason).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..runtime.dist import local
from .lora import plain_module

# the names a wrapper puts before its module's parameters (activation checkpointing's, torch.compile's)
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@contextlib.contextmanager
def weights_on_meta() -> Iterator[_Writes]:
    """Modules built inside it hold their parameters on the meta device (no memory) and their buffers as built: a
    parameter is moved there as it is registered (a buffer, a BatchNorm's statistics or a rotary table, is computed
    by its module's constructor and cannot be drawn again). Yields what notes the values a network gives its
    weights itself (`why`), which the meta device would lose."""
    register, writes = nn.Module.register_parameter, _Writes()

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            if param.numel() and param.untyped_storage().data_ptr() not in writes.empty:
                writes.note(f"its {type(module).__name__} registers a weight '{name}' with values of its own")
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with writes, warnings.catch_warnings():
            # (torch's warning of a copy into a meta parameter: noted here, and the model then built whole)
            warnings.filterwarnings("ignore", ".*copying from a non-meta parameter", UserWarning)
            yield writes
    finally:
        nn.Module.register_parameter = register


# the in-place operations that only write values (a layer's initialisation): on a meta tensor, which holds none,
# passed over (torch's meta kernels of the random ones import sympy, 1.1 s and 155 MB in every worker)
_VALUES_ONLY = {getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "fill_", "zero_", "copy_", "erfinv_", "mul_", "add_", "sub_", "div_", "clamp_",
    "exponential_", "bernoulli_", "random_", "log_normal_", "cauchy_", "geometric_", "fmod_", "abs_", "sign_")} | {
    getattr(nn.init, name) for name in (  # (torch hands the mode nn.init's own functions, not the calls inside them)
        "normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
        "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "eye_", "dirac_")}
# the methods in which a module draws its own weights: what they write is drawn again, module by module
_DRAWS = {"reset_parameters", "_reset_parameters", "reset_running_stats"}


class _Writes(TorchFunctionMode):
    """Passes over the values written into a meta tensor, and notes (`why`) the values a network gives its weights
    outside its modules' reset_parameters: data copied in (a factory that loads weights), an initialisation its
    constructor makes itself. Such values would be lost on the meta device: the network is then built whole."""

    def __init__(self) -> None:
        super().__init__()
        self.why, self.empty = "", set()  # `empty`: the storages of torch.empty's tensors (a layer's unset weights)

    def note(self, why: str) -> None:
        self.why = self.why or why

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # (nn.init's: given by name)
        if func in _VALUES_ONLY and isinstance(target, torch.Tensor) and target.is_meta:
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if func is torch.Tensor.copy_ and isinstance(source, torch.Tensor) and not source.is_meta:
                self.note("its factory writes data into the weights (a network of yours that loads them)")
            elif not _drawing():
                self.note("its constructor sets its weights' values itself, outside its layers' reset_parameters")
            return target
        out = func(*args, **kwargs)
        if func is torch.empty and isinstance(out, torch.Tensor) and not out.is_meta:
            self.empty.add(out.untyped_storage().data_ptr())
        return out


def _drawing() -> bool:
    """Whether a module's own reset_parameters (or the like) is running, up the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _DRAWS:
            return True
        frame = frame.f_back
    return False


def leaf_seed(seed: int, name: str) -> int:
    """The seed of module `name`'s weights: the run's seed and the module's name, nothing else."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def _own(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters(recurse=False))


class Initial:
    """The initial weights of a model built on the meta device: `values(name)` draws the module holding parameter
    `name` (whole, on the CPU); `fill` gives every parameter of a laid-out copy of that model its part."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        # a copy kept as built (meta: no memory), whatever the layouts do to the model after
        self.pristine, self.seed = copy.deepcopy(model), seed
        modules = dict(self.pristine.named_modules())
        # every parameter's module and own name, under each name it has (a weight two modules share: its first's)
        owner: dict[int, tuple[str, str]] = {}
        for path, module in modules.items():
            for n, p in _own(module):
                owner.setdefault(id(p), (path, n))
        self.owner = {name: owner[id(p)] for name, p in self.pristine.named_parameters(remove_duplicate=False)}
        self.modules = modules

    @classmethod
    def of(cls, model: nn.Module, seed: int, why: str = "") -> tuple[Initial | None, str]:
        """The initial weights of `model`, built inside weights_on_meta; or None and why, where its modules cannot
        draw their weights (then it is built whole). `why`: what weights_on_meta noted of the build."""
        if why:
            return None, why
        if any(b.is_meta for b in model.buffers()):
            return None, "a buffer of it is made on the meta device (from a weight's values)"
        from torch.nn.modules.lazy import LazyModuleMixin

        for path, module in model.named_modules():
            if isinstance(module, LazyModuleMixin):
                return None, f"its module '{path}' ({type(module).__name__}) takes its shapes from its first input"
            if _own(module) and not callable(getattr(module, "reset_parameters", None)):
                return None, (f"its module '{path or type(module).__name__}' ({type(module).__name__}) holds weights "
                              "and has no reset_parameters to draw them")
            if any(not p.is_meta for _, p in _own(module)):
                return None, f"its module '{path}' holds weights that are not drawn (assigned after it was built)"
        return cls(model, seed), ""

    def values(self, name: str) -> dict[str, torch.Tensor]:
        """The initial values, whole, on the CPU, of the module that holds parameter `name`, by their own names."""
        return self._draw(self.owner[name][0])

    def _draw(self, path: str, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Module `path`'s weights drawn by its reset_parameters from its seed: into `into` (every one of its
        weights, on the CPU, by its own name), or into new tensors."""
        module = copy.copy(self.modules[path])  # its own dicts, its submodules shared: only its weights drawn
        module._parameters = {n: None if p is None else  # (a layer without bias holds None under its name)
                              nn.Parameter(into[n] if into else torch.empty(p.shape, dtype=p.dtype),
                                           requires_grad=p.requires_grad)
                              for n, p in module._parameters.items()}
        module._buffers = {n: b.clone() if b is not None else None for n, b in module._buffers.items()}
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # (the CPU's generator alone: a GPU's untouched)
            # (an adapted layer's own weights under its plain name: the model with LoRA starts from the model's)
            torch.default_generator.manual_seed(leaf_seed(self.seed, plain_module(path)))
            module.reset_parameters()
        return {n: p.detach() for n, p in _own(module)}

    def fill(self, model: nn.Module, device: torch.device) -> nn.Module:
        """`model` (this one laid out: cut, split, sharded, still on the meta device) on `device`, each parameter
        holding its part of its initial value (a DTensor its local part), each buffer as built. Always drawn on the
        CPU (a GPU's generator draws other numbers): in place where a module's weights are whole there."""
        materialised(model, device)
        self.draw(model)
        return model

    def draw(self, model: nn.Module, only: Callable[[str], bool] | None = None) -> None:
        """The initial values of `model`'s parameters (given memory: materialised), of those `only` names where
        given (a LoRA run's adapters, beside weights read from a pretrained folder)."""
        held: dict[str, dict[str, torch.Tensor]] = {}  # by the module that draws them
        for n, p in model.named_parameters():
            if only is not None and not only(_plain(n)):
                continue
            path, own = self.owner[_plain(n)]
            held.setdefault(path, {})[own] = p
        with torch.no_grad():
            for path, mine in held.items():
                whole = len(mine) == len(_own(self.modules[path])) and all(
                    p.device.type == "cpu" and not hasattr(p, "device_mesh") for p in mine.values())
                drawn = self._draw(path, {n: p.data for n, p in mine.items()} if whole else None)
                for own, p in ({} if whole else mine).items():
                    local(p).copy_(_part(drawn[own], p))


def _part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This worker's part of `whole`, as `like` holds it (a DTensor's local part, cut without a collective)."""
    if not hasattr(like, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


def placed(model: nn.Module, initial: Initial | None, device: torch.device) -> nn.Module:
    """`model` on `device`: where it was built on the meta device (and laid out), each weight given its part of its
    initial value; else moved there whole."""
    return model.to(device) if initial is None else initial.fill(model, device)


def copy_into(model: nn.Module, source: nn.Module) -> nn.Module:
    """`model`, a copy of `source` laid out alike and still on the meta device, with `source`'s weights where they
    are (each worker its own part, on its device or, offloaded, in CPU memory): a sharded weight average starts as
    the weights are."""
    materialised(model, local(next(source.parameters())).device)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), source.named_parameters(), strict=True):
            local(p).copy_(local(q))
    return model


def materialised(model: nn.Module, device: torch.device) -> None:
    """`model`'s parameters given memory on `device` (their values not set), its buffers moved there as built. A
    sharded model's go through to_empty (FSDP2 follows its parameters' storage there); a plain model's are made
    with torch.empty (to_empty's empty_like of a meta tensor imports sympy: 1 s and 150 MB in every worker)."""
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        buffers = {n: b for n, b in model.named_buffers()}
        model.to_empty(device=device)
        with torch.no_grad():
            for n, b in model.named_buffers():  # (to_empty leaves the buffers empty too)
                if n in buffers and not buffers[n].is_meta:
                    b.copy_(buffers[n])
        return
    tied: dict[int, list[tuple[nn.Module, str]]] = {}  # a weight two modules share, under each of its names
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                tied.setdefault(id(p), []).append((module, name))
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t.to(device))
    for holders in tied.values():  # (the meta device's parameters are replaced one by one: shared ones tied again)
        first = holders[0][0]._parameters[holders[0][1]]
        for module, name in holders[1:]:
            module._parameters[name] = first


def _plain(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
