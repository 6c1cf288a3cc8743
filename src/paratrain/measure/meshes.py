"""`paratrain plan` for a transformer: which mesh (copies, sharded copies, tensor parallelism) a step would run
fastest on N devices, from the bench's one-device compute and the link, by the alpha-beta ring model of
scaling.py. Per step of a mesh of c = dp x fsdp copies and tp tensor-parallel workers:

- compute: a copy's batch (the global batch / c) x the compute per example / tp. Tensor parallelism splits the
  blocks' matrix products; the norms and embeddings it leaves whole are taken as split too (a bound);
- tensor parallelism: 2 all-reduces of the activations (a copy's tokens x width x 4 bytes) a block in the
  forward and 2 in the backward, over the tp workers, never hidden (the next layer waits for them);
- the copies: dp's gradient all-reduce or fsdp's 1.5x traffic, of 1/tp of the gradients, over the c copies,
  hidden behind the backward where it fits (scaling.step_time_s);
- memory, a worker's peak: the model state (weights, gradients, optimizer state: 16 bytes a weight under Adam,
  or what the bench's one device held a weight), split over fsdp x tp (dp copies it), and --ema's average (4
  bytes a weight, as split); the activations, what one device's peak added beyond its state an example (the
  bench's measure: the GPU's allocated bytes, or the process's resident set on the CPU) times a copy's examples,
  tp splitting those inside the attention and the MLP (24 of a block's 34 bytes a token and width, Megatron-LM's
  count: `TP_SPLIT`); and under fsdp the weights of two blocks gathered at once (the next one is fetched ahead)
  and one block's gradients before they are reduce-scattered, each split by tp.

tp stays within a node (8 devices at most) and divides the heads; among the meshes whose copies split the global
batch and whose peak fits the device's memory (--device-memory-gb), the fastest is chosen. Where tensor
parallelism pays: where the global batch has fewer examples than the devices (copies alone cannot use them), and
where a device cannot hold a copy's share of the state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..parallel.mesh import Mesh
from . import scaling

STATE_BYTES = 16  # a trained weight's float32 value, gradient and Adam's two moments
FROZEN_BYTES = 4  # a frozen weight's (--lora: the model's own) value alone
EMA_BYTES = 4  # --ema's float32 average of a weight
TP_SPLIT = 24 / 34  # the share of a block's activations tp splits (Megatron-LM: 34 bytes a token and width, 24 split)
# fsdp's unsharded blocks at once: on a GPU two blocks' weights (one fetched ahead) and one block's gradients; a CPU
# fetches none ahead, but its gathered buffer and the weights copied out of it meet (2.5 blocks measured)
GATHERED = 3
NODE = 8  # the devices tensor parallelism may span (one node's links)


@dataclasses.dataclass(frozen=True)
class Transformer:
    depth: int
    width: int
    heads: int
    tokens: int  # an example's
    weights: int
    largest_block: int = 0  # the weights of the largest piece fsdp gathers at once
    trained: float = 1.0  # the share of the weights trained (--lora: the adapters')

    @property
    def state_per_weight(self) -> float:
        """Adam's bytes a weight, unmeasured: 16 a trained weight, 4 a frozen one."""
        return FROZEN_BYTES + (STATE_BYTES - FROZEN_BYTES) * self.trained


@dataclasses.dataclass(frozen=True)
class Bytes:
    """What one device held, measured by the bench (or Adam's 16 bytes a weight and no activations, unmeasured):
    the model state a weight, the rest of its peak an example, and whether --ema's average was kept."""
    per_weight: float = STATE_BYTES
    per_example: float = 0.0
    ema: bool = False
    measured: bool = False  # whether the bench recorded its peak added (the activations counted)

    def peak(self, model: Transformer, mesh: Mesh, global_batch: int) -> dict[str, float]:
        """A worker's bytes on `mesh`: its state, its activations and fsdp's gathered blocks, and their sum."""
        split = mesh.fsdp * mesh.tp
        state = (self.per_weight + (EMA_BYTES if self.ema else 0)) * model.weights / split
        acts = self.per_example * global_batch / mesh.copies * ((1 - TP_SPLIT) + TP_SPLIT / mesh.tp)
        gathered = GATHERED * 4.0 * model.largest_block / mesh.tp if mesh.fsdp > 1 else 0.0
        return {"state_bytes": state, "activation_bytes": acts, "gathered_bytes": gathered,
                "peak_bytes": state + acts + gathered}


def measured_bytes(results: dict, base: dict, model: Transformer) -> Bytes:
    """`Bytes` from the bench's one-device row: its model state a weight (Adam's 16 bytes where it recorded none)
    and its peak added beyond that state, an example (None in a bench of before 2026-12-01: the activations
    unknown)."""
    state, added = base.get("model_state_bytes"), base.get("peak_memory_added_bytes")
    ema = "--ema" in results.get("train_flags", [])
    per_weight = state / model.weights if state else model.state_per_weight
    if added is None:
        return Bytes(per_weight, ema=ema)
    extra = added - (per_weight + (EMA_BYTES if ema else 0)) * model.weights
    return Bytes(per_weight, max(extra, 0.0) / base["global_batch_size"], ema, measured=True)


def of_bench(results: dict) -> Transformer | None:
    """The bench's model as tensor parallelism sees it, or None where it is not the gpt."""
    from ..models.gpt import shape

    net, sample, _ = scaling.bench_network(scaling.bench_model(results), scaling.bench_shape(results))
    dims = shape(net)
    if dims is None:
        return None
    return Transformer(dims["depth"], dims["width"], dims["heads"], int(sample(1)[0].shape[1]),
                       sum(p.numel() for p in net.parameters()), max(scaling.block_sizes_of(net)),
                       scaling.trained_share(net))


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
          memory: float | None = None, held: Bytes = Bytes()) -> list[dict[str, Any]]:
    """Every candidate mesh of n devices: tokens/s, a worker's bytes (`Bytes.peak`), whether its peak fits, and
    the choice."""
    rows = []
    for mesh in candidates(n, model.heads):
        peak = held.peak(model, mesh, global_batch)
        rate = global_batch * model.tokens / step_s(w, model, mesh, global_batch, bandwidth, latency)
        rows.append({"devices": n, "mesh": mesh.text(), "tokens_per_sec": rate, **peak,
                     "fits": memory is None or peak["peak_bytes"] <= memory,
                     "splits": global_batch % mesh.copies == 0, "chosen": False})
    fitting = [r for r in rows if r["fits"] and r["splits"]]
    if fitting:
        max(fitting, key=lambda r: r["tokens_per_sec"])["chosen"] = True
    return rows


def print_tables(w: scaling.Workload, model: Transformer, max_devices: int, global_batch: int, bandwidth: float,
                 latency: float, memory: float | None, held: Bytes = Bytes()) -> list[dict[str, Any]]:
    """The meshes of 1, 2, 4, ... devices (up to 128), each worker's bytes at its peak, the chosen one marked."""
    measured = (f"{held.per_weight:.1f} bytes of state a weight and {held.per_example / 1e6:,.1f} MB an example "
                "beyond it, as the bench's one device held them" if held.measured else
                f"{held.per_weight:.1f} bytes of state a weight, the activations not counted (a bench of before "
                "recorded no peak added)")
    print(f"meshes for the {model.weights:,}-weight transformer ({model.depth} blocks, width {model.width}, "
          f"{model.heads} heads), global batch {global_batch}: tp = 4 all-reduces of the activations a block a step, "
          f"never hidden; a worker's peak = {measured}" + (", and --ema's average" if held.ema else "")
          + "; fsdp gathers 2 blocks' weights and 1 block's gradients at once"
          + (f"; a device holds {memory / 1e9:g} GB" if memory else ""))
    print(f"{'devices':>8}  {'mesh':<16}{'tokens/s':>14}{'state MB':>11}{'activations MB':>16}{'gathered MB':>13}"
          f"{'peak MB':>10}  ")
    every, n = [], 1
    while n <= min(max_devices, 128):
        for r in table(w, model, n, global_batch, bandwidth, latency, memory, held):
            mark = "<- chosen" if r["chosen"] else "(the batch does not split over its copies)" if not r["splits"] \
                else "(does not fit)" if not r["fits"] else ""
            print(f"{n:>8}  {r['mesh']:<16}{r['tokens_per_sec']:>14,.0f}{r['state_bytes'] / 1e6:>11,.1f}"
                  f"{r['activation_bytes'] / 1e6:>16,.1f}{r['gathered_bytes'] / 1e6:>13,.1f}"
                  f"{r['peak_bytes'] / 1e6:>10,.1f}  {mark}")
            every.append(r)
        n *= 2
    return every
