"""A Hugging Face decoder as the pieces a pipeline cuts: its embeddings, each block of its block list, and its
final norm with the head (`LlamaForCausalLM` and its kin keep them at `model.embed_tokens`, `model.layers`,
`model.norm`, `lm_head`; `GPT2LMHeadModel` at `transformer.wte`/`wpe`/`drop`, `transformer.h`, `transformer.ln_f`,
`lm_head`).

A stage is the model itself with the pieces of other stages removed, so that its weights keep the whole model's
names (its checkpoint parts line up with one device's, and with transformers'), and its forward runs its own
pieces in order. Each piece does what the model's forward does around that piece (positions, the causal mask, the
rotary embeddings), and `pieces_of` accepts a model only where its pieces in order compute exactly what the model
does (checked on random token ids, in evaluation and in training mode): a decoder that does more (Gemma's scaled
embeddings, say) is refused in one line rather than trained as another network. Where the embedding and the head
share one weight (GPT-2's), the first and the last stage each hold it, and the pipeline adds their gradients
(stages.Pipeline), so that each update is one device's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# where a decoder's parts live, tried in order: (base, embeddings in order, block list, final norm)
ANATOMIES = (("model", ("embed_tokens",), "layers", "norm"),
             ("transformer", ("wte", "wpe", "drop"), "h", "ln_f"))


@dataclass(frozen=True)
class Piece:
    """One piece of a decoder by the paths of what it runs: kind "embed" (token embedding, then the position
    embedding and the dropout where the model has them), "block" (one block) or "head" (final norm, head)."""

    kind: str
    paths: tuple[str, ...]
    base: str
    rotary: str | None = None

    def run(self, model: nn.Module, x: torch.Tensor, shared: dict[str, Any]) -> torch.Tensor:
        """The piece on `x`; `shared` holds what every block of one forward takes alike (made once a forward)."""
        parts = [model.get_submodule(p) for p in self.paths]
        if self.kind == "head":
            return parts[1](parts[0](x))
        if self.kind == "embed":
            h = parts[0](x)
            if len(parts) > 1:  # a learned position embedding, then the embeddings' dropout
                h = parts[2](h + parts[1](torch.arange(x.shape[1], device=x.device).unsqueeze(0)))
            return h
        if not shared:
            shared.update(_around_blocks(model, self, x))
        out = parts[0](x, **shared)
        return out[0] if isinstance(out, tuple) else out


def _around_blocks(model: nn.Module, piece: Piece, h: torch.Tensor) -> dict[str, Any]:
    """What the model's forward hands each block without a cache, made once a forward as the model makes it:
    the positions, the causal mask its attention implementation takes (none for sdpa, which masks causally
    itself; the positions are not given to it: from them it would look for packed sequences, a read of the
    device's memory every forward), and the rotary embeddings where the model has them."""
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    mask = create_causal_mask(config=model.get_submodule(piece.base).config, inputs_embeds=h, attention_mask=None,
                              cache=None)
    shared = {"attention_mask": mask, "position_ids": positions}
    if piece.rotary:
        shared["position_embeddings"] = model.get_submodule(piece.rotary)(h, position_ids=positions)
    return shared


def anatomy(model: nn.Module) -> list[Piece] | None:
    """The pieces of `model` in order, where it is laid out as a Hugging Face decoder (None where not)."""
    for base, embeddings, blocks, norm in ANATOMIES:
        inner = getattr(model, base, None)
        if not isinstance(inner, nn.Module) or not isinstance(getattr(model, "lm_head", None), nn.Module):
            continue
        found = tuple(e for e in embeddings if isinstance(getattr(inner, e, None), nn.Module))
        layers = getattr(inner, blocks, None)
        if found[:1] != embeddings[:1] or not isinstance(layers, nn.ModuleList) or not hasattr(inner, norm) \
                or not hasattr(inner, "config"):
            continue
        if len(found) > 1 and found != embeddings:  # a position embedding comes with its dropout
            continue
        rotary = f"{base}.rotary_emb" if isinstance(getattr(inner, "rotary_emb", None), nn.Module) else None
        return [Piece("embed", tuple(f"{base}.{e}" for e in found), base),
                *(Piece("block", (f"{base}.{blocks}.{i}",), base, rotary) for i in range(len(layers))),
                Piece("head", (f"{base}.{norm}", "lm_head"), base)]
    return None


class PieceModule(nn.Module):
    """One piece as a layer of its own, for what counts and shows the layers (costs, --print-split): it holds the
    piece's modules (their parameters) and runs the piece on the whole model."""

    def __init__(self, model: nn.Module, piece: Piece) -> None:
        super().__init__()
        for i, path in enumerate(piece.paths):
            self.add_module(f"part{i}", model.get_submodule(path))
        object.__setattr__(self, "whole", model)  # not a child: its weights are not this piece's
        self.piece = piece
        self.label = type(model.get_submodule(piece.paths[0])).__name__ if piece.kind == "block" else \
            "+".join(type(model.get_submodule(p)).__name__ for p in piece.paths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.piece.run(self.whole, x, {})


class Pieces(nn.Sequential):
    """A decoder as the sequence of its pieces (what a pipeline cuts: its own weights' names are the pieces',
    `0.part0.weight`); `whole` is the model itself, of which `stage` makes each stage's module, named as the
    model is."""

    def __init__(self, model: nn.Module, pieces: list[Piece]) -> None:
        super().__init__(*(PieceModule(model, p) for p in pieces))
        object.__setattr__(self, "whole", model)

    def stage(self, lo: int, hi: int) -> nn.Module:
        """The model with only pieces lo..hi-1 left (the others' modules removed, the names of those kept
        unchanged: `model.layers.5` stays `model.layers.5`), whose forward runs those pieces in order."""
        model: nn.Module = self.whole
        mine = [m.piece for m in list(self)[lo:hi]]
        kept = {p for piece in mine for p in piece.paths}
        for piece in (m.piece for m in self):
            for path in piece.paths:
                if path not in kept:
                    _remove(model, path)
        model.__class__ = _stage_class(type(model))
        model._paratrain_pieces = mine
        return model


def _remove(model: nn.Module, path: str) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    if isinstance(parent, nn.ModuleList):
        del parent._modules[name]  # the other blocks keep their numbers (their names in a checkpoint)
    else:
        setattr(parent, name, None)


_STAGE_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    """`cls` whose forward runs the stage's pieces (a class of its own, as FSDP2 makes one: a deep copy, the
    weight average's, runs its own copy's pieces)."""
    if cls not in _STAGE_CLASSES:
        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            shared: dict[str, Any] = {}
            for piece in self._paratrain_pieces:
                x = piece.run(self, x, shared)
            return x

        _STAGE_CLASSES[cls] = type(f"{cls.__name__}Stage", (cls,), {"forward": forward})
    return _STAGE_CLASSES[cls]


def pieces_of(model: nn.Module, example: torch.Tensor, checked: bool = False) -> Pieces | None:
    """`model` as its pieces, where it is laid out as a decoder and its pieces in order compute exactly what it
    does on random token ids of `example`'s length (None where not). `checked`: the launching process has
    compared them already (a worker does not copy the whole model again to do it)."""
    found = anatomy(model)
    if found is None or example.is_floating_point() or example.dim() != 2:
        return None
    pieces = Pieces(model, found)
    if checked:
        return pieces
    vocabulary = model.get_submodule(found[0].paths[0]).num_embeddings
    ids = torch.randint(0, vocabulary, (1, example.shape[1]), generator=torch.Generator().manual_seed(0))
    return pieces if same_output(model, lambda m: Pieces(m, anatomy(m) or []), ids) else None


def stage_blocks(module: nn.Module) -> list[nn.Module] | None:
    """A decoder's stage's blocks (None for any other module): what fsdp shards one at a time, as the stage's
    forward calls its pieces and not its top-level children (the rest is the root's)."""
    pieces = getattr(module, "_paratrain_pieces", None)
    return None if pieces is None else [module.get_submodule(p.paths[0]) for p in pieces if p.kind == "block"]


def same_output(model: nn.Module, cut: Callable[[nn.Module], nn.Module], x: torch.Tensor) -> bool:
    """Whether `cut(model)`, the model's layers in order, computes exactly what the model does on `x` (its scores,
    where it returns a mapping): in evaluation mode and, on copies under the same random state, in training mode
    (dropout and other steps only training takes)."""
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            if not torch.equal(_scores(model(x)), cut(model)(x)):
                return False
            whole = copy.deepcopy(model).train()  # copies: BatchNorm statistics of the real one stay untouched
            outputs = []
            for net in (whole, cut(whole)):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    outputs.append(_scores(net(x)))
            return bool(torch.equal(*outputs))
    except Exception:  # noqa: BLE001 (a forward that needs more than its layers in order: not a sequence)
        return False
    finally:
        model.train(was_training)


def _scores(output: Any) -> torch.Tensor:
    return output["logits"] if isinstance(output, dict) or hasattr(output, "keys") else output
