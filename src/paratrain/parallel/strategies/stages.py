"""The pipeline machinery that strategies/pipeline.py and hybrid.py use: where to cut the layers (pure
functions), one process's stage and its schedule (torch.distributed.pipelining, GPipe or 1F1B) on a 2-D
DeviceMesh (dp x pp), and evaluation through that schedule.

Every process builds the whole model from the same seed on the CPU (so every layout starts from one
device's weights) and keeps only its stage's layers, which it moves to its device. No process holds the
whole model after that: evaluation runs the schedule forward only, and checkpoints are sharded, each stage
writing its own layers under the whole model's names (strategies/base.py, checkpoint/dcp.py).
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.flop_counter import FlopCounterMode

from ...core.errors import UserError
from ...data.batches import eval_range
from ...features.dropout import GlobalBatchDropout
from ...runtime.dist import average_gradients
from ..mesh import Mesh, device_mesh
from .base import autocast as cast_to

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # pipeline schedules (not lr schedules)


def layers_of(model: nn.Module, name: str, example: torch.Tensor) -> nn.Sequential:
    """The model as a sequence of layers: an nn.Sequential as it is; another module whose forward is its
    children applied in order (checked on `example`: the same output, exactly) as an nn.Sequential of those
    children under their own names, so that its weights keep the model's names (checkpoints load back into
    the model)."""
    if isinstance(model, nn.Sequential):
        return model
    children = OrderedDict(model.named_children())
    own = list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False))
    if children and not own and _same_output(model, nn.Sequential(children), example):
        return nn.Sequential(children)
    raise UserError(f"--strategy pipeline/hybrid needs a model that is a sequence of layers (lenet5, convnet, "
                    f"cifar10-net, mlp, an nn.Sequential, or a module whose forward applies its children in "
                    f"order); '{name}' is not one")


def example_batch(cfg: Any, data: Any, n: int) -> torch.Tensor:
    """A batch of `n` zero examples as the first stage takes them: images at the model's input size, or the
    data's own inputs (kind "tensors"), whose shapes fix the stages' buffers."""
    if not data.images:
        return torch.zeros(n, *data.input_shape, dtype=data.train[0].dtype)
    from ...models import input_size

    side = input_size(cfg.model, data.image_size)
    return torch.zeros(n, data.channels, side, side)


def _same_output(model: nn.Module, layers: nn.Sequential, example: torch.Tensor) -> bool:
    """Whether the children in order compute what the model does: on a seeded random batch of the example's
    shape (zeros would hide a scaling of the input or a residual around it), in evaluation mode and, on
    copies under the same random state, in training mode (dropout and other steps only training takes)."""
    x = torch.randn(example.shape, generator=torch.Generator().manual_seed(0))
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            if not torch.equal(model(x), layers(x)):
                return False
            whole = copy.deepcopy(model).train()  # copies: BatchNorm statistics of the real one stay untouched
            cut = nn.Sequential(OrderedDict(whole.named_children()))
            outputs = []
            for net in (whole, cut):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    outputs.append(net(x))
            return bool(torch.equal(*outputs))
    except Exception:  # noqa: BLE001 (a forward that needs more than the children: not a sequence)
        return False
    finally:
        model.train(was_training)


# ---- where to cut (pure functions, and the counted cost they balance) ----

@torch.no_grad()
def layer_costs(model: nn.Sequential, example: torch.Tensor) -> list[float]:
    """Counted forward cost of each layer for one example: FLOPs of its matrix products and convolutions
    (FlopCounterMode) plus one operation per output element, the memory-bound part that activations,
    pooling and normalisation consist of. Counted in evaluation mode: the same operations, and a BatchNorm
    after a 1x1 feature map cannot fail on the one example's batch statistics (training mode would); the
    model's mode is put back."""
    costs, x = [], example
    was_training = model.training
    model.eval()
    try:
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                y = layer(x)
            costs.append(float(counter.get_total_flops() + y.numel()))
            x = y
    finally:
        model.train(was_training)
    return costs


def balanced_cuts(costs: list[float], k: int) -> list[int]:
    """The k-1 cut points (the layer index where each stage after the first starts) that make the
    costliest stage as cheap as possible: the linear partition problem, solved exactly."""
    n = len(costs)
    if not 1 <= k <= n:
        raise UserError(f"--stages {k}: the model has {n} layers; use 2 to {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: the lowest possible maximum stage cost for the first i layers in j stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):  # the last stage holds layers s..i-1
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, s
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        cuts.append(i)
    return sorted(cuts)


def parse_split(spec: str, n_layers: int, k: int) -> list[int]:
    """`--split 3,5` -> [3, 5]: stage 1 is layers 0-2, stage 2 layers 3-4, stage 3 the rest."""
    try:
        cuts = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise UserError(f"--split '{spec}': write auto or cut points such as 3,5") from None
    if len(cuts) != k - 1 or cuts != sorted(set(cuts)) or not all(0 < c < n_layers for c in cuts):
        raise UserError(f"--split '{spec}': {k} stages need {k - 1} increasing cut points between 1 and "
                        f"{n_layers - 1} (the model has {n_layers} layers; see --print-split)")
    return cuts


def stage_bounds(cuts: list[int], n_layers: int) -> list[tuple[int, int]]:
    edges = [0, *cuts, n_layers]
    return list(zip(edges[:-1], edges[1:], strict=True))


def resolve_cuts(model: nn.Sequential, split: str, k: int, example: torch.Tensor) -> tuple[list[int], list[float]]:
    costs = layer_costs(model, example)
    cuts = balanced_cuts(costs, k) if split == "auto" else parse_split(split, len(model), k)
    return cuts, costs


def split_table(model: nn.Sequential, cuts: list[int], costs: list[float]) -> str:
    """What --print-split shows: each stage's layers, parameters and share of the counted cost."""
    total = sum(costs)
    lines = [f"{'stage':<6}{'layers':<10}{'parameters':>12}{'cost (MFLOP/ex)':>17}{'share':>8}  contents"]
    for s, (lo, hi) in enumerate(stage_bounds(cuts, len(model))):
        params = sum(p.numel() for i in range(lo, hi) for p in model[i].parameters())
        cost = sum(costs[lo:hi])
        names = ", ".join(type(model[i]).__name__ for i in range(lo, hi))
        lines.append(f"{s:<6}{f'{lo}-{hi - 1}':<10}{params:>12,}{cost / 1e6:>17.3f}{cost / total:>8.1%}  {names}")
    return "\n".join(lines)


def theoretical_bubble(k: int, m: int) -> float:
    return (k - 1) / (m + k - 1)


# ---- the optimizer state of one stage from a whole-model checkpoint file (a pure function) ----

def slice_optimizer_state(full: dict, offset: int, count: int) -> dict:
    """The part of a whole-model optimizer state dict that belongs to parameters offset..offset+count-1."""
    if len(full["param_groups"]) != 1:
        raise UserError("this checkpoint's optimizer has several parameter groups; a pipeline cannot split it")
    state = {i - offset: v for i, v in full["state"].items() if offset <= int(i) < offset + count}
    return {"state": state, "param_groups": [{**full["param_groups"][0], "params": list(range(count))}]}


# ---- the processes ----

@dataclass(frozen=True)
class StagePlace:
    """This process's stage, of `stages`, in pipeline copy `replica`, of `replicas` (its place on the mesh's pp
    and data-parallel dimensions: parallel/mesh.py)."""

    stages: int
    replicas: int
    stage: int
    replica: int

    @classmethod
    def of(cls, mesh: Mesh, rank: int) -> StagePlace:
        where = mesh.coordinates(rank)
        return cls(mesh.pp, mesh.copies, where["pp"], where["dp"] * mesh.fsdp + where["fsdp"])


class _TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it spends computing, to measure the bubble (idle time), and places
    the dropout masks of each chunk it runs forward at the chunk's rows of the global batch (features/dropout.py)."""

    busy_s = 0.0
    chunk_share = (0, 1)  # (this copy, of how many copies), each cut into `chunks`
    chunks = 1
    first_call = 0  # the dropout calls of the stages before this one, in one forward

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.busy_s += time.perf_counter() - start
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        mode = GlobalBatchDropout.current
        if mode is not None:
            (copy, copies), m = self.chunk_share, self.chunks
            mode.place(copy * m + fwd_chunk_id, copies * m, self.first_call)
        return self._timed(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    """`t` with zero rows added to make `size` rows."""
    if len(t) == size:
        return t
    return torch.cat([t, t.new_zeros((size - len(t), *t.shape[1:]))])


class Pipeline:
    """This process's stage of a K-stage pipeline (one of R copies) and its schedule."""

    def __init__(self, full: nn.Sequential, cuts: tuple[int, ...], place: StagePlace, device: torch.device,
                 microbatches: int, schedule: str, example: torch.Tensor, loss: Any = F.cross_entropy,
                 built: DeviceMesh | None = None, shard: Callable[[nn.Module], nn.Module] | None = None,
                 autocast: torch.dtype | None = None, accumulate: int = 1) -> None:
        """`built`: the run's device mesh (default: one of pp x dp); `shard`: what splits the stage's layers
        further (tensor parallelism) before the stage is made; `autocast`: the type every forward autocasts to
        (--precision bf16); `accumulate`: the batches whose gradients add up before an update (--accumulate).
        The example goes through the layers before the stage under the CPU's autocast;
        torch's PipelineStage (2.14) types what a stage receives and sends from its first forward, which runs
        under the device's."""
        K = place.stages
        self.place, self.device, self.microbatches = place, device, microbatches
        built = built or device_mesh(Mesh(pp=K, dp=place.replicas), device.type)
        self.pp_group, self.dp_group = built.get_group("pp"), built.get_group("dp")
        lo, hi = stage_bounds(cuts, len(full))[place.stage]
        # the stage's layers, named as in the whole model: its checkpoint parts and a whole model's file line up
        self.module = nn.Sequential(OrderedDict(list(full.named_children())[lo:hi])).to(device)
        if shard is not None:
            self.module = shard(self.module)
        self.param_offset = sum(1 for i in range(lo) for _ in full[i].parameters())
        self.micro = example.shape[0]  # the stage's static shapes: evaluation runs batches of micro x microbatches
        # the shape of a micro-batch where it enters this stage, and the dropout calls before it
        self.cast = lambda: cast_to(device.type, autocast)
        with torch.no_grad(), GlobalBatchDropout(torch.device("cpu"), (0, 1), 0, 0, 0) as before, \
                cast_to("cpu", autocast):
            inp = nn.Sequential(*list(full)[:lo])(example)
        self.stage = _TimedStage(self.module, place.stage, K, device, input_args=(inp.to(device),),
                                 group=self.pp_group)
        self.stage.chunk_share, self.stage.chunks = (place.replica, place.replicas), microbatches
        self.stage.first_call = before.call
        # --accumulate K: each batch's loss is divided by K (the schedule divides its gradients by the
        # micro-batches, scale_grads), and step() adds each batch's gradients to those of the batches before
        self.accumulate = accumulate
        self.schedule = SCHEDULE_CLASSES[schedule](self.stage, microbatches,
                                                   loss_fn=lambda out, target: loss(out, target) / accumulate)
        self.is_first, self.is_last = place.stage == 0, place.stage == K - 1
        self.wall_s = 0.0

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one batch through the pipeline; gradients accumulate in the stage,
        scaled so that they equal those of the update's mean loss (the batch's, under --accumulate 1). The last
        stage returns the batch's mean loss and the logits; the others return (None, None)."""
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        # the gradients of the batches accumulated before this one, put aside: the schedule divides the whole
        # .grad by its micro-batches after the batch, which must not divide theirs again
        parameters = list(self.module.parameters())
        before = [p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        with self.cast():
            if self.is_first:
                self.schedule.step(x)
            elif self.is_last:
                logits = self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        for p, grad in zip(parameters, before, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else grad.add_(p.grad)
        self.wall_s += time.perf_counter() - start
        if not self.is_last:
            return None, None
        return torch.stack(losses).mean() * self.accumulate, logits

    def average_gradients(self) -> None:
        """Hybrid: average each stage's gradients over the R copies of the pipeline (one flat all-reduce)."""
        if self.place.replicas > 1:
            average_gradients(self.module.parameters(), self.place.replicas, self.dp_group)

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: Any, loss: Any, flip: bool,
                 meter: Any = None) -> torch.Tensor:
        """This copy's share of the split through the schedule, forward only: the last stage's sums
        (evaluation.batch_sums'; zeros on the other stages). The stage's shapes are fixed, so the share goes in batches
        of one copy's training batch, the last one padded with zeros and its padding's outputs dropped (in
        evaluation mode every example's output is its own). The measured bubble leaves this time out (the
        schedule's setting itself up for training again, a small exchange in the next step, counts there)."""
        from ...optimization.evaluation import SUMS, batch_sums

        x_all, y_all = pair
        share = eval_range(len(y_all), self.place.replica, self.place.replicas)
        size = self.micro * self.microbatches
        sums = torch.zeros(SUMS, dtype=torch.float64, device=self.device)
        busy, was_training = self.stage.busy_s, self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for start in range(share.start, share.stop, size):
                    n = min(size, share.stop - start)
                    x = _padded(prep.eval(x_all[start:start + n]), size) if self.is_first else None
                    y = _padded(y_all[start:start + n].to(self.device), size) if self.is_last else None
                    logits = self._forward(x, y)
                    if flip:  # test-time augmentation: the mean with the mirror image's outputs
                        mirrored = self._forward(x.flip(3) if x is not None else None, y)
                        logits = (logits + mirrored) / 2 if self.is_last else None
                    if self.is_last:
                        sums += batch_sums(logits[:n], y[:n], loss)
                        if meter is not None:  # the other stages' metrics update nothing (zeros)
                            meter.update(logits[:n], y[:n])
        finally:
            self.module.train(was_training)
            self.stage.busy_s = busy
        return sums

    def _forward(self, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        """One batch through the schedule, forward only: the logits on the last stage (which also needs the
        targets: the schedule computes its loss there), None on the others."""
        with self.cast():
            if self.is_first:
                self.schedule.eval(x)
                return None
            if self.is_last:
                return self.schedule.eval(target=y)
            self.schedule.eval()
            return None

    def load_optimizer(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        optimizer.load_state_dict(slice_optimizer_state(full, self.param_offset, len(list(self.module.parameters()))))

    def bubble(self) -> dict[str, Any]:
        """Measured idle fraction of every stage (of this copy) beside the theory, (K-1)/(M+K-1) (collective)."""
        mine = 1.0 - self.stage.busy_s / self.wall_s if self.wall_s else float("nan")
        idle: list[Any] = [None] * self.place.stages
        dist.all_gather_object(idle, mine, group=self.pp_group)
        return {"measured_idle_fraction": idle, "measured_mean": sum(idle) / len(idle),
                "theoretical": theoretical_bubble(self.place.stages, self.microbatches)}
