"""The device mesh: the workers as a grid of named dimensions, one place that reads, checks and builds it.

    pp    pipeline stages (the layers cut into consecutive pieces)
    dp    copies of the model (data parallel, each copy whole)
    fsdp  sharded copies (each worker holds 1/fsdp of every weight, FSDP2)
    tp    tensor parallelism (each block's heads and hidden units split, DTensor)

A worker's rank is its place in the grid in this order, tp innermost: tensor parallelism exchanges activations
in every block, forward and backward, so its workers are neighbours (one node, the fastest links); a pipeline
only hands activations from stage to stage, so it is outermost (torchtitan orders its `ParallelDims` alike).

Every strategy is a mesh (`of`): ddp = dp=N, fsdp = fsdp=N, hsdp = dp=R,fsdp=S, pipeline = pp=K, hybrid =
dp=R,pp=K, tp = tp=N; `--mesh` names any composition, and `strategy_for` gives the strategy that runs it (the
tp strategy for one with tensor parallelism). No torch at import: the launching process checks meshes without it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "fsdp", "tp")  # outermost first; a worker's rank is its place in this order
MEANING = {"pp": "pipeline stages", "dp": "copies", "fsdp": "sharded copies", "tp": "tensor-parallel workers"}


@dataclass(frozen=True)
class Mesh:
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def workers(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def copies(self) -> int:
        """Into how many shares the global batch splits: the data-parallel workers (whole or sharded)."""
        return self.dp * self.fsdp

    @property
    def splits_model(self) -> bool:
        """Whether each worker holds a part of the model's weights, not a whole copy (fsdp, tp or pp above 1)."""
        return max(self.fsdp, self.tp, self.pp) > 1

    def text(self) -> str:
        """As --mesh takes it: `dp=2,tp=2` (the dimensions above 1; `dp=1` for one worker)."""
        return ",".join(f"{d}={n}" for d, n in self.sizes.items() if n > 1) or "dp=1"

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where worker `rank` sits on each dimension."""
        where = {}
        for d in reversed(DIMS):
            rank, where[d] = divmod(rank, getattr(self, d))
        return {d: where[d] for d in DIMS}


@functools.cache
def parse(text: str) -> Mesh:
    """`--mesh fsdp=2,tp=2` -> Mesh(fsdp=2, tp=2); a malformed one is one line. Read once per process: every
    later reader of the same --mesh (the strategy's checks, the batch split, the plan) shares that Mesh, and the
    workers never read it (the plan's Layout carries it)."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
        if not m or m.group(1) not in DIMS:
            what = f"'{m.group(1)}' is not a dimension" if m else f"cannot read '{part}'"
            raise UserError(f"--mesh '{text}': {what}; write named sizes such as fsdp=2,tp=2, each of "
                            f"{', '.join(f'{d} ({MEANING[d]})' for d in DIMS)}")
        if m.group(1) in sizes:
            raise UserError(f"--mesh '{text}' names {m.group(1)} twice")
        if int(m.group(2)) < 1:
            raise UserError(f"--mesh '{text}': {m.group(1)} must be 1 or more")
        sizes[m.group(1)] = int(m.group(2))
    return Mesh(**sizes)


def of(strategy: str, workers: int, stages: int | None = None, shard_size: int | None = None) -> Mesh:
    """The mesh a strategy runs `workers` on (its shorthand). The tower drives its devices from one process:
    one worker, dp=1."""
    if strategy in ("ddp", "tower"):
        return Mesh(dp=workers) if strategy == "ddp" else Mesh()
    if strategy == "fsdp":
        return Mesh(fsdp=workers)
    if strategy == "hsdp":
        size = shard_size or workers
        return Mesh(dp=workers // size, fsdp=size)
    if strategy in ("pipeline", "hybrid"):
        return Mesh(pp=stages or 1, dp=workers // (stages or 1))
    return Mesh(tp=workers)


def strategy_for(mesh: Mesh) -> dict[str, Any]:
    """The configuration that runs `mesh`: its strategy, and the options that strategy reads (the inverse of
    `of`)."""
    if mesh.tp > 1 or (mesh.pp > 1 and mesh.fsdp > 1):
        return {"strategy": "tp"}
    if mesh.pp > 1:
        return {"strategy": "hybrid" if mesh.dp > 1 else "pipeline", "stages": mesh.pp}
    if mesh.fsdp > 1:
        return {"strategy": "hsdp", "shard_size": mesh.fsdp} if mesh.dp > 1 else {"strategy": "fsdp"}
    return {"strategy": "ddp"}


def elsewhere(cfg: Any, workers: Any) -> str:
    """Where a resumed run's layout cannot take the `workers` asked for: how to carry it on under another layout
    on them (every layout reads every other's checkpoints); nothing for a new run."""
    if not cfg.resume:
        return ""
    return f"; or carry the run on under another layout: --strategy ddp --devices {workers}"


def resolved(cfg: Any) -> Any:
    """`cfg` with its --mesh turned into the strategy that runs it and --devices its product (one line if
    --devices names another count, or --strategy another strategy)."""
    if not cfg.mesh:
        return cfg
    mesh = parse(cfg.mesh)
    if cfg.devices not in ("auto", str(mesh.workers)):
        other = "" if cfg.devices == "1" else f", or give a --mesh of {cfg.devices} workers"  # (no mesh is 1)
        raise UserError(f"--mesh {cfg.mesh} is {mesh.workers} workers (the product of its sizes), not --devices "
                        f"{cfg.devices}; leave --devices out{other}" + elsewhere(cfg, cfg.devices))
    wanted = strategy_for(mesh)
    if cfg.strategy not in ("ddp", wanted["strategy"]):  # ddp: the default, not a choice
        raise UserError(f"--mesh {cfg.mesh} runs as --strategy {wanted['strategy']}, not {cfg.strategy}; leave "
                        "--strategy out")
    if wanted["strategy"] in ("pipeline", "hybrid") and cfg.stages not in (None, mesh.pp):
        raise UserError(f"--mesh {cfg.mesh} has pp={mesh.pp}, not --stages {cfg.stages}; leave --stages out")
    if wanted["strategy"] == "hsdp" and cfg.shard_size not in (None, mesh.fsdp):
        raise UserError(f"--mesh {cfg.mesh} has fsdp={mesh.fsdp}, not --shard-size {cfg.shard_size}; leave "
                        "--shard-size out")
    # the mesh stays in the configuration where its strategy reads it (tp); another strategy's own options
    # (stages, shard size, workers) say it all, and carry on as that strategy's do
    kept = mesh.text() if wanted["strategy"] == "tp" else None
    return dataclasses.replace(cfg, mesh=kept, devices=str(mesh.workers), **wanted)


def for_run(cfg: Any, workers: int) -> Mesh:
    """The mesh of a run of `cfg` on `workers` workers (checked: its product is the workers)."""
    mesh = parse(cfg.mesh) if cfg.mesh else of(cfg.strategy, workers, cfg.stages, cfg.shard_size)
    if mesh.workers != workers:
        raise UserError(f"--mesh {mesh.text()} is {mesh.workers} workers, not the {workers} this run starts; give "
                        f"--devices {mesh.workers}")
    return mesh


def check_model(mesh: Mesh, shape: dict[str, int], flags: dict[str, str] | None = None) -> None:
    """One line where the model's sizes do not split over the mesh: `shape` has its heads, key/value heads,
    width, hidden units and vocabulary (those it knows: a network of your own's are not; a pipeline's stages
    are checked where its layers are cut). `flags`: the flag that sets a size, where one does (the gpt's)."""
    for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads"), ("width", "width"),
                      ("hidden", "MLP's hidden units"), ("vocabulary", "vocabulary")):
        if shape.get(key) and shape[key] % mesh.tp:
            flag = (flags or {}).get(key)
            raise UserError(f"tp={mesh.tp} does not divide the model's {shape[key]} {what}; use a tp that divides "
                            f"{shape[key]}" + (f", or set them with {flag}" if flag else ""))


def check_adapters(mesh: Mesh, lora: int, lora_dropout: float) -> None:
    """One line where the mesh cannot train --lora's adapters as one device would: in a pipeline (a stage's cut
    is counted on the model's plain layers), or with their dropout under tp (a rowwise layer's adapter sees its
    worker's part of the input, and its mask would not be one device's)."""
    if lora and mesh.pp > 1:
        raise UserError("--lora: the adapters are trained under ddp, fsdp and tp (and their meshes), not yet in a "
                        "pipeline; give --strategy fsdp, ddp or tp, or leave --lora out")
    if lora and lora_dropout and mesh.tp > 1:
        raise UserError("--lora-dropout: under tp a rowwise layer's adapter sees its worker's part of the input, and "
                        "its dropout would not be one device's; give --lora-dropout 0 under tp")


def device_mesh(mesh: Mesh, device_type: str) -> DeviceMesh:
    """The N-D DeviceMesh of every dimension (sizes of 1 included: each strategy slices the ones it uses)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(mesh.sizes.values()), mesh_dim_names=DIMS)


def data_mesh(mesh: Mesh, built: DeviceMesh) -> DeviceMesh:
    """The part of `built` that FSDP2 shards over: fsdp alone, or (dp, fsdp) (HSDP: replicated over dp)."""
    return built["fsdp"] if mesh.dp == 1 else built["dp", "fsdp"]
