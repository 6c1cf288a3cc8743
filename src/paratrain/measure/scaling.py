"""`paratrain plan`: predict data-parallel throughput beyond this machine from a bench's measurements.

Cost model (every assumption is printed with the table):
- a step on each of N devices = per-device batch b x compute time per example (measured on one device,
  taken as linear in b) + a fixed per-step cost (data indexing + optimizer, measured);
- the gradient all-reduce is a ring: 2(N-1)/N x bytes / bandwidth + 2(N-1) x latency (alpha-beta), plus
  paratrain's one 24-byte all-reduce per step (the loss, time-up and stop flags) at the same cost;
- fsdp (sharded) instead all-gathers each block's weights in the forward and again in the backward and
  reduce-scatters its gradients: 3 x (N-1)/N x bytes (1.5x the all-reduce's) and 3(N-1) latencies per block;
  its optimizer updates 1/N of the weights;
- with overlap, the all-reduce runs during the backward pass (2/3 of the compute) and only what sticks
  out of it adds to the step; without overlap it adds whole;
- weak scaling (a fixed batch per device) unless a global batch is given (strong scaling);
- devices do not slow each other's compute (true of separate GPUs). CPU worker processes on one host do:
  they share caches and memory bandwidth. To validate on CPU workers, that slowdown is measured on its own
  (N processes computing without communicating) and applied to the compute term.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import UserError

# Effective all-reduce bus bandwidth (bytes/s) and per-message latency (s): round published figures.
LINKS = {
    "pcie4": (20e9, 5e-6),  # PCIe 4.0 x16 through host memory
    "nvlink4": (370e9, 3e-6),  # H100 NVLink 4 (NCCL bus bandwidth)
    "ib-ndr": (45e9, 5e-6),  # InfiniBand NDR 400 Gb/s between nodes
    "ethernet-25g": (2.8e9, 30e-6),  # 25 GbE with TCP
}
DATA_PARALLEL = ("ddp-cpu", "gpu", "fsdp-cpu", "fsdp-gpu")  # the bench's rows the model predicts
CPU_WORKERS = ("ddp-cpu", "fsdp-cpu")  # worker processes sharing this host's cores (no overlap; co-located)
FLAG_BYTES = 24  # the per-step all-reduce of the training loop: [loss, time up, stop] in float64
BACKWARD_FRACTION = 2 / 3  # backward ~ 2x forward: the window an all-reduce can hide in


def ring_allreduce_s(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def sharded_traffic_s(n: int, nbytes: float, bandwidth: float, latency: float, blocks: int,
                      trained: float = 1.0) -> float:
    """fsdp's collectives a step: two ring all-gathers of the weights (forward, backward) and a ring
    reduce-scatter of the gradients (of the `trained` share of the weights: LoRA's adapters), (N-1)/N x bytes
    each, in one message per block each."""
    if n <= 1:
        return 0.0
    return (2 + trained) * (n - 1) / n * nbytes / bandwidth + 3 * (n - 1) * latency * blocks


@dataclass(frozen=True)
class Workload:
    compute_per_example_s: float
    fixed_per_step_s: float  # data and optimizer
    grad_bytes: float  # the weights' bytes (float32): fsdp gathers them all
    optimizer_per_step_s: float = 0.0  # the optimizer's part of fixed_per_step_s (sharded: 1/N of it)
    blocks: int = 1  # the blocks fsdp shards one at a time (and the root)
    trained: float = 1.0  # the share of the weights trained, whose gradients are reduced (LoRA: the adapters')


def step_time_s(w: Workload, n: int, per_device_batch: float, bandwidth: float, latency: float,
                overlap: bool, sharded: bool = False, traffic_s: float | None = None) -> float:
    """One step on each of n devices; `traffic_s`: fsdp's collectives as measured (measure_sharded_traffic)
    rather than modelled."""
    compute = per_device_batch * w.compute_per_example_s
    fixed = w.fixed_per_step_s
    if sharded:
        comm = sharded_traffic_s(n, w.grad_bytes, bandwidth, latency, w.blocks, w.trained) if traffic_s is None \
            else traffic_s
        fixed -= w.optimizer_per_step_s * (1 - 1 / n)
    else:
        comm = ring_allreduce_s(n, w.grad_bytes * w.trained, bandwidth, latency)
    # with overlap the collectives run beside the compute (fsdp prefetches the next block's weights)
    window = (1.0 if sharded else BACKWARD_FRACTION) * compute
    exposed = max(0.0, comm - window) if overlap else comm
    flags = ring_allreduce_s(n, FLAG_BYTES, bandwidth, latency)  # after backward: never hidden
    return compute + fixed + exposed + flags


def predict(w: Workload, n: int, bandwidth: float, latency: float, overlap: bool,
            per_device_batch: float | None = None, global_batch: float | None = None,
            sharded: bool = False, traffic_s: float | None = None) -> dict[str, float]:
    """Throughput and scaling efficiency on n devices (against the same model on one device), data parallel
    or (`sharded`) fsdp."""
    b = global_batch / n if global_batch else per_device_batch
    one_b = global_batch if global_batch else per_device_batch
    rate = n * b / step_time_s(w, n, b, bandwidth, latency, overlap, sharded, traffic_s)
    rate_1 = one_b / step_time_s(w, 1, one_b, bandwidth, latency, overlap, sharded)
    return {"devices": n, "examples_per_sec": rate, "speedup": rate / rate_1, "efficiency": rate / rate_1 / n}


def workload_from_bench(results: dict) -> tuple[Workload, dict]:
    """The 1-device row of a bench (cpu:1t, gpu:1, or ddp-cpu:1): compute per example, fixed cost, and
    the gradient size of the bench's model."""
    rows = {r["name"]: r for r in results["results"] if r["status"] == "ok" and r.get("step_phases_s")}
    base = rows.get("gpu:1") or rows.get("cpu:1t") or rows.get("ddp-cpu:1")
    if base is None:
        raise UserError("the bench has no 1-device row with a step breakdown (gpu:1, cpu:1t or ddp-cpu:1); "
                        "run `paratrain bench` with one of them")
    net, _, _ = bench_network(bench_model(results), bench_shape(results))
    sizes = block_sizes_of(net)
    phases = base["step_phases_s"]
    w = Workload(phases["compute"] / base["global_batch_size"], phases["data"] + phases["optimizer"],
                 4.0 * sum(sizes), phases["optimizer"], len(sizes), trained_share(net))
    return w, base


def trained_share(net: Any) -> float:
    """The share of a network's weights that train (all but where --lora freezes the model's own)."""
    total = sum(p.numel() for p in net.parameters())
    return sum(p.numel() for p in net.parameters() if p.requires_grad) / total if total else 1.0


def model_cost(results: dict) -> dict[str, Any] | None:
    """A language model's cost from the bench's model (models/flops.py): its tokens an example and FLOPs a
    token; None where its inputs are not token ids."""
    from ..models.flops import flops_per_token

    net, sample, _ = bench_network(bench_model(results), bench_shape(results))
    x, _ = sample(1)
    if x.is_floating_point() or x.dim() != 2:
        return None
    flops, counted = flops_per_token(net, x.shape[1])
    return {"tokens": int(x.shape[1]), "flops_per_token": flops, "counted": counted}


def block_sizes_of(net: Any) -> list[int]:
    """The weights of each piece fsdp gathers at once in `net`: its blocks, then the root's own."""
    from ..parallel.strategies.fsdp import blocks

    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks(net, None)]
    return [*sizes, sum(p.numel() for p in net.parameters()) - sum(sizes)]


def measure_sharded_traffic(model: str, shape: dict[str, Any], n: int, repeats: int = 15) -> float:
    """Seconds a step of fsdp costs beyond the computation among n local gloo processes: the bench's model
    sharded as fsdp shards it, its forward and backward on a small batch, less the same unsharded in the same
    processes. That holds its collectives (two all-gathers of each block's weights, a reduce-scatter of its
    gradients: on gloo the reduce-scatter costs more than an all-reduce of the same bytes) and what FSDP2
    spends around them a block (hooks, copies into and out of the gathered buffers), which the ring model's
    bytes cannot say."""
    import torch.multiprocessing as mp

    from ..runtime.proc import reserved_port

    queue = mp.get_context("spawn").SimpleQueue()
    with reserved_port() as port:
        mp.start_processes(_time_sharded, args=(port, model, shape, n, repeats, queue), nprocs=n,
                           start_method="spawn")
    return queue.get()


def _time_sharded(rank: int, port: int, model: str, shape: dict[str, Any], n: int, repeats: int,
                  queue) -> None:  # noqa: ANN001
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..parallel.strategies.fsdp import blocks
    from ..runtime.dist import loopback_store
    from ..runtime.proc import on_loopback

    torch.set_num_threads(1)
    on_loopback()
    dist.init_process_group("gloo", store=loopback_store(rank, n, port), rank=rank, world_size=n)
    net, sample, loss = bench_network(model, shape)
    plain = copy.deepcopy(net)
    mesh = init_device_mesh("cpu", (n,))
    for block in blocks(net, None):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh, reshard_after_forward=False)
    x, y = sample(8)

    def median_step(m: Any) -> float:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            m.zero_grad(set_to_none=True)
            loss(m(x), y).backward()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[2:])  # the first steps allocate

    extra = median_step(net) - median_step(plain)
    if rank == 0:
        queue.put(max(extra, 0.0))
    dist.destroy_process_group()


def measure_link(sizes: tuple[int, ...] = (1, 2**14, 2**18, 2**21), repeats: int = 20) -> tuple[float, float]:
    """All-reduce bandwidth and latency between 2 local gloo processes, fitted to the ring model."""
    import torch.multiprocessing as mp

    from ..runtime.proc import reserved_port

    queue = mp.get_context("spawn").SimpleQueue()
    with reserved_port() as port:
        mp.start_processes(_time_allreduce, args=(port, sizes, repeats, queue), nprocs=2, start_method="spawn")
    times = queue.get()
    xs, ys = [4.0 * s for s in sizes], times  # with n=2: t = bytes / bw + 2 x latency
    slope, intercept = statistics.linear_regression(xs, ys)
    return 1.0 / slope, max(intercept / 2, 0.0)


def _time_allreduce(rank: int, port: int, sizes: tuple[int, ...], repeats: int, queue) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from ..runtime.dist import loopback_store
    from ..runtime.proc import on_loopback

    torch.set_num_threads(1)
    on_loopback()
    dist.init_process_group("gloo", store=loopback_store(rank, 2, port), rank=rank, world_size=2)
    out = []
    for size in sizes:
        t = torch.ones(size)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        out.append(statistics.median(samples))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_colocation(model: str, base_batch: int, batch: int, n: int, steps: int = 30,
                       shape: dict[str, Any] | None = None) -> float:
    """Compute time per example of n 1-thread processes that each run forward + backward at `batch` on this
    host at once (no communication: they share only caches and memory bandwidth), over that of one process
    alone at `base_batch` (the bench's 1-device row). Both timings come from the same processes, one right
    after the other, so machine drift mostly cancels."""
    import torch.multiprocessing as mp

    from ..runtime.proc import reserved_port

    queue = mp.get_context("spawn").SimpleQueue()
    with reserved_port() as port:
        mp.start_processes(_time_compute, args=(port, n, model, (base_batch, batch), steps, queue, shape),
                           nprocs=n, start_method="spawn")
    results = [queue.get() for _ in range(n)]
    alone = next(t for rank, t, _ in results if rank == 0)
    return statistics.fmean(t for _, _, t in results) / batch / (alone / base_batch)


def _time_compute(rank: int, port: int, n: int, model: str, batches: tuple[int, int], steps: int,
                  queue, shape: dict[str, Any] | None = None) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from ..runtime.proc import tune_malloc

    torch.set_num_threads(1)
    tune_malloc()  # as in a training worker
    net, sample, loss = bench_network(model, shape)

    def median_step(batch: int) -> float:
        x, y = sample(batch)
        for _ in range(3):  # warm-up: first-touch allocations
            loss(net(x), y).backward()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            net.zero_grad(set_to_none=True)
            loss(net(x), y).backward()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    from ..runtime.dist import loopback_store
    from ..runtime.proc import on_loopback

    on_loopback()
    dist.init_process_group("gloo", store=loopback_store(rank, n, port), rank=rank, world_size=n)
    dist.barrier()
    alone = median_step(batches[0]) if rank == 0 else 0.0  # the others wait in the barrier below
    dist.barrier()
    together = median_step(batches[1])
    dist.barrier()
    queue.put((rank, alone, together))
    dist.destroy_process_group()


def validate(results: dict, w: Workload, bandwidth: float, latency: float,
             slowdown: dict[int, float] | None = None, traffic: dict[int, float] | None = None) -> list[dict]:
    """The model's prediction for every measured multi-device data-parallel row of the bench (ddp and fsdp),
    beside the measurement. `slowdown[n]` scales the compute of n co-located CPU workers (measure_colocation);
    `traffic[n]`: fsdp's collectives among n CPU workers as measured (measure_sharded_traffic)."""
    out = []
    for r in results["results"]:
        if r["status"] != "ok" or r["family"] not in DATA_PARALLEL or r["devices"] < 2:
            continue
        factor = (slowdown or {}).get(r["devices"], 1.0) if r["family"] in CPU_WORKERS else 1.0
        wr = dataclasses.replace(w, compute_per_example_s=w.compute_per_example_s * factor)
        predicted = predict(wr, r["devices"], bandwidth, latency, overlap=r["family"] not in CPU_WORKERS,
                            global_batch=r["global_batch_size"], sharded=r["family"].startswith("fsdp"),
                            traffic_s=(traffic or {}).get(r["devices"]) if r["family"] in CPU_WORKERS
                            else None)["examples_per_sec"]
        measured = r["examples_per_sec"]["mean"]
        out.append({"name": r["name"], "measured": measured, "predicted": predicted,
                    "colocation_slowdown": factor, "error": predicted / measured - 1})
    return out


def bench_network(model: str, shape: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """The bench's model with the bench's shaping options (`shape`: --width, --depth, ...), built for its own
    kind of image, or for its data where that is not images (a table, token ids: --dataset in `shape`): the
    network, `sample(batch)` giving a batch of inputs and targets, and the loss."""
    import torch
    import torch.nn.functional as F

    from ..data import synthetic_side
    from ..models import build_model, input_size, native_channels

    shape = dict(shape or {})
    data = {k: shape.pop(k) for k in ("dataset", "data_dir", "target") if k in shape}
    if data.get("dataset") in TENSORS:
        from .. import config as C
        from ..components.build import make_model
        from ..components.inputs import load_for
        from ..config.fields import model_for_data
        from ..optimization.losses import training_loss

        cfg = C.validate(model_for_data(C.TrainConfig(model=model, **shape, **data)))
        splits = load_for(cfg)
        x_all, y_all = splits.train

        def rows(batch: int) -> tuple[Any, Any]:
            idx = torch.arange(batch) % len(y_all)
            return x_all[idx], y_all[idx]

        return make_model(cfg, splits), rows, training_loss(cfg, splits.categorical)
    channels = native_channels(model)
    side = input_size(model, synthetic_side(channels))

    def images(batch: int) -> tuple[Any, Any]:
        return torch.randn(batch, channels, side, side), torch.randint(0, 10, (batch,))

    return build_model(model, channels, side, 10, **shape), images, F.cross_entropy


# the datasets that are not images: their own network and batch
TENSORS = ("diabetes", "tokens", "tensors", "csv", "text", "jsonl")
SHAPES = {"--width": int, "--depth": int, "--activation": str, "--filters": int, "--kernel": int, "--dataset": str,
          "--data-dir": str, "--target": str, "--context": int, "--heads": int, "--tokenizer": str, "--columns": str,
          "--lora": int, "--lora-targets": str}


def bench_shape(results: dict) -> dict[str, Any]:
    """The options the bench's flags set that shape its model (an MLP's --width: its gradients' bytes)."""
    flags = results["train_flags"]
    return {flag[2:].replace("-", "_"): kind(flags[flags.index(flag) + 1]) for flag, kind in SHAPES.items()
            if flag in flags}


def bench_model(results: dict) -> str:
    """The bench's --model, or the default one for its data (the gpt for text, ...)."""
    from ..config.fields import TrainConfig, model_for_data

    flags = results["train_flags"]
    if "--model" in flags:
        return flags[flags.index("--model") + 1]
    dataset = flags[flags.index("--dataset") + 1] if "--dataset" in flags else TrainConfig.dataset
    return model_for_data(TrainConfig(dataset=dataset)).model


def load_results(path: str) -> dict:
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read bench results {p} ({e}); pass the folder `paratrain bench --out` wrote") from None
