"""`paratrain plan` for a transformer: which mesh (copies, sharded copies, tensor parallelism) a step would run
fastest on N devices, from the bench's one-device compute and the link, by the alpha-beta ring model of
scaling.py. Per step of a mesh of c = dp x fsdp copies and tp tensor-parallel workers:

- compute: a copy's batch (the global batch / c) x the compute per example / tp. Tensor parallelism splits the
  blocks' matrix products; the norms and embeddings it leaves whole are taken as split too (a bound);
- tensor parallelism: 2 all-reduces of the activations (a copy's tokens x width x 4 bytes) a block in the
  forward and 2 in the backward, over the tp workers, never hidden (the next layer waits for them);
- the copies: dp's gradient all-reduce or fsdp's 1.5x traffic, of 1/tp of the gradients, over the c copies,
  hidden behind the backward where it fits (scaling.step_time_s);
- memory: weights, gradients and Adam's two moments, 16 bytes a weight, split over fsdp x tp (dp copies it).

tp stays within a node (8 devices at most) and divides the heads; among the meshes whose copies split the global
batch and whose state fits the device's memory (--device-memory-gb), the fastest is chosen. Activations' memory is
left out. Where tensor parallelism pays: where the global batch has fewer examples than the devices (copies
alone cannot use them), and where a device cannot hold a copy's share of the state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..parallel.mesh import Mesh
from . import scaling

STATE_BYTES = 16  # a weight's float32 value, gradient and Adam's two moments
NODE = 8  # the devices tensor parallelism may span (one node's links)


@dataclasses.dataclass(frozen=True)
class Transformer:
    depth: int
    width: int
    heads: int
    tokens: int  # an example's
    weights: int


def of_bench(results: dict) -> Transformer | None:
    """The bench's model as tensor parallelism sees it, or None where it is not the gpt."""
    from ..models.gpt import shape

    net, sample, _ = scaling.bench_network(scaling.bench_model(results), scaling.bench_shape(results))
    dims = shape(net)
    if dims is None:
        return None
    return Transformer(dims["depth"], dims["width"], dims["heads"], int(sample(1)[0].shape[1]),
                       sum(p.numel() for p in net.parameters()))


def candidates(n: int, heads: int) -> list[Mesh]:
    """The meshes of n devices: tp a power of 2 that divides the heads (within a node), the rest copies,
    whole (dp) or sharded (fsdp)."""
    out, tp = [], 1
    while tp <= min(n, NODE, heads):
        if n % tp == 0 and heads % tp == 0:
            c = n // tp
            out.append(Mesh(dp=c, tp=tp))
            if c > 1:
                out.append(Mesh(fsdp=c, tp=tp))
        tp *= 2
    return out


def step_s(w: scaling.Workload, model: Transformer, mesh: Mesh, global_batch: int, bandwidth: float,
           latency: float) -> float:
    b = global_batch / mesh.copies  # a copy's examples
    tp_comm = 4 * model.depth * scaling.ring_allreduce_s(mesh.tp, b * model.tokens * model.width * 4.0, bandwidth,
                                                         latency)
    split = dataclasses.replace(w, compute_per_example_s=w.compute_per_example_s / mesh.tp,
                                grad_bytes=w.grad_bytes / mesh.tp)
    return scaling.step_time_s(split, mesh.copies, b, bandwidth, latency, True, sharded=mesh.fsdp > 1) + tp_comm


def table(w: scaling.Workload, model: Transformer, n: int, global_batch: int, bandwidth: float, latency: float,
          memory: float | None = None) -> list[dict[str, Any]]:
    """Every candidate mesh of n devices: tokens/s, state bytes a device, whether it fits, and the choice."""
    rows = []
    for mesh in candidates(n, model.heads):
        held = STATE_BYTES * model.weights / (mesh.fsdp * mesh.tp)
        rate = global_batch * model.tokens / step_s(w, model, mesh, global_batch, bandwidth, latency)
        rows.append({"devices": n, "mesh": mesh.text(), "tokens_per_sec": rate, "state_bytes": held,
                     "fits": memory is None or held <= memory, "splits": global_batch % mesh.copies == 0,
                     "chosen": False})
    fitting = [r for r in rows if r["fits"] and r["splits"]]
    if fitting:
        max(fitting, key=lambda r: r["tokens_per_sec"])["chosen"] = True
    return rows


def print_tables(w: scaling.Workload, model: Transformer, max_devices: int, global_batch: int, bandwidth: float,
                 latency: float, memory: float | None) -> list[dict[str, Any]]:
    """The meshes of 2, 4, ... devices (up to 128), the chosen one marked."""
    print(f"meshes for the {model.weights:,}-weight transformer ({model.depth} blocks, width {model.width}, "
          f"{model.heads} heads), global batch {global_batch}: tp = 4 all-reduces of the activations a block a step, "
          f"never hidden; state = {STATE_BYTES} bytes a weight over fsdp x tp"
          + (f"; a device holds {memory / 1e9:g} GB" if memory else ""))
    print(f"{'devices':>8}  {'mesh':<16}{'tokens/s':>14}{'state/device':>16}  ")
    every, n = [], 2
    while n <= min(max_devices, 128):
        for r in table(w, model, n, global_batch, bandwidth, latency, memory):
            mark = "<- chosen" if r["chosen"] else "(the batch does not split over its copies)" if not r["splits"] \
                else "(does not fit)" if not r["fits"] else ""
            print(f"{n:>8}  {r['mesh']:<16}{r['tokens_per_sec']:>14,.0f}{r['state_bytes'] / 1e6:>13,.1f} MB  {mark}")
            every.append(r)
        n *= 2
    return every
