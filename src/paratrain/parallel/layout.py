"""A run's layout: how it is spread over its workers, decided once in the launching process (runplan.make,
through its strategy's `arrange` and `prepare`) and carried to every worker in the plan, typed. Workers read
it; none parses --mesh or works a mesh out of the configuration again.

    strategy   the name the run was asked by (--strategy, or the one that runs its --mesh): how its workers
               are driven (parallel/strategies/)
    mesh       the named sizes pp, dp, fsdp, tp (parallel/mesh.py); ddp = dp=N, fsdp = fsdp=N, ...
    cuts       a pipeline's cut points (pp > 1), resolved once from --split
    replicas   the tower's devices, driven from one process (its mesh is that one process)

No torch at import: the launching process plans without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mesh import Mesh


@dataclass(frozen=True)
class Layout:
    strategy: str = "ddp"
    mesh: Mesh = Mesh()
    cuts: tuple[int, ...] = ()
    replicas: tuple[str, ...] = ()

    def describe(self) -> str:
        """The run's start line's words for it: '(fsdp: mesh fsdp=2, each holds 1/2 of the model)'; '' for one
        worker."""
        if self.replicas:
            return f" ({self.strategy}: {len(self.replicas)} replicas driven from one process)"
        mesh = self.mesh
        if mesh.workers == 1:
            return ""
        gloss = ""
        if mesh.fsdp > 1 and mesh.workers == mesh.fsdp:
            gloss = f", each holds 1/{mesh.fsdp} of the model"
        elif mesh.fsdp > 1 and mesh.workers == mesh.copies:
            gloss = f", {mesh.dp} copies x {mesh.fsdp} shards"
        return f" ({self.strategy}: mesh {mesh.text()}{gloss})"
