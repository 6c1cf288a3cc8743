"""The fsdp dimension's units: the blocks that FSDP2 shards one at a time (each block's weights all-gathered
just before it runs, its gradients reduce-scattered after), which the composition (composed.py: `fully_shard`
over the mesh's data dimensions) and --compile share. The names fsdp and hsdp are in names.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import UserError

if TYPE_CHECKING:
    from torch import nn



def blocks(model: nn.Module, names: str | None) -> list[nn.Module]:
    """The modules sharded one at a time: those named in `names` (comma-separated module names), a decoder's
    stage's blocks (its forward calls its pieces, not its top-level children: the rest is the root's), or the
    model's top-level children that hold weights (the registry's models are built as a row of blocks)."""
    if names:
        found = dict(model.named_modules())
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for name in wanted:
            if name not in found or name == "":
                top = ", ".join(n for n, _ in model.named_children())
                raise UserError(f"--shard-modules names '{name}', which this network does not have; its "
                                f"top-level modules are: {top}")
        return [found[n] for n in wanted]
    from .decoder import stage_blocks

    decoder = stage_blocks(model)
    if decoder is not None:
        return decoder
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_units(model: nn.Module, names: str | None) -> list[nn.Module | list[nn.Module]]:
    """The blocks as FSDP2 shards them, one group each: blocks that share a weight (GPT-2's embedding, in its
    body, and its head) together in one group, as FSDP2 requires of a shared weight."""
    units: list[list[nn.Module]] = []
    for block in blocks(model, names):
        mine = {id(p) for p in block.parameters()}
        sharing = [u for u in units if any(id(p) in mine for m in u for p in m.parameters())]
        merged = [m for u in sharing for m in u] + [block]
        units = [u for u in units if u not in sharing] + [merged]
    return [u[0] if len(u) == 1 else u for u in units]
