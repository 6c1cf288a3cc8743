"""The pipeline machinery of a mesh with pp > 1 (composed.py runs it): one process's
stage and its schedule (torch.distributed.pipelining, GPipe or 1F1B) on the run's DeviceMesh, the weights that
stages share, and evaluation through that schedule (where the layers are cut: cuts.py).

Every process builds the whole model from the same seed on the CPU (so every layout starts from one
device's weights) and keeps only its stage's layers, which it moves to its device. No process holds the
whole model after that: evaluation runs the schedule forward only, and checkpoints are sharded, each stage
writing its own layers under the whole model's names (strategies/base.py, checkpoint/dcp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ...core.errors import UserError
from ...data.batches import eval_range
from ...features.dropout import GlobalBatchDropout
from ...features.precision import autocast as cast_to
from ...runtime.device_time import DeviceTime
from ...runtime.dist import average_gradients
from ..mesh import Mesh, device_mesh
from .cuts import run_layer, stage_bounds, stage_module, theoretical_bubble, whole_model

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # pipeline schedules (not lr schedules)


# ---- the weights that stages share ----

def tied_weights(full: nn.Sequential, bounds: list[tuple[int, int]], stage: int) -> list[nn.Parameter | None]:
    """The weights that layers of different stages share (GPT-2's embedding and head), in the model's order, each
    as this stage's parameter where it holds it, else None. Only a model's first and last stage may share one."""
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for s, (lo, hi) in enumerate(bounds):
        for layer in list(full)[lo:hi]:
            for p in layer.parameters():
                holders.setdefault(id(p), (p, set()))[1].add(s)
    shared = [(p, stages) for p, stages in holders.values() if len(stages) > 1]
    if any(stages != {0, len(bounds) - 1} for _, stages in shared):
        raise UserError("a weight is shared by layers of stages other than the first and the last; cut the "
                        "pipeline elsewhere (--split)")
    return [p if stage in stages else None for p, stages in shared]


def ends_group(built: DeviceMesh) -> Any:
    """The process group of this worker's first and last stage (of its copy, its shard), from the mesh's ranks:
    every rank makes every such group (a collective call), in one order."""
    first, last = built.mesh[0].flatten().tolist(), built.mesh[-1].flatten().tolist()
    mine = None
    for pair in zip(first, last, strict=True):
        group = dist.new_group(list(pair))
        if dist.get_rank() in pair:
            mine = group
    return mine


def _numbers(whole: list[tuple[str, nn.Parameter]], stage: nn.Module) -> list[int]:
    """The numbers of the stage's parameters in the whole model's optimizer (a shared weight: its one number)."""
    numbers = {id(p): i for i, (_, p) in enumerate(whole)}
    return [numbers[id(p)] for p in stage.parameters()]


def _aliases(whole: list[tuple[str, nn.Parameter]], stage: nn.Module, tied: list[str]) -> dict[str, str]:
    """{the stage's name: the whole model's} of a shared weight this stage holds (named in `tied`) under another
    name than the model's first (the last stage's `lm_head.weight`, the model's `transformer.wte.weight`): a
    checkpoint of another layout holds its state under the model's name only."""
    first, held = {id(p): n for n, p in whole}, dict(stage.named_parameters())
    return {n: first[id(held[n])] for n in tied if first[id(held[n])] != n}


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
    """A PipelineStage that adds up the device time it spends computing, to measure the bubble (idle time), and
    places the dropout masks of each chunk it runs forward at the chunk's rows of the global batch
    (features/dropout.py)."""

    busy: DeviceTime | None = None  # where its chunks' time adds up (None: not timed, as in evaluation)
    chunk_share = (0, 1)  # (this copy, of how many copies), each cut into `chunks`
    chunks = 1
    first_call = 0  # the dropout calls of the stages before this one, in one forward

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.busy is None:
            return fn(*args, **kwargs)
        begun = self.busy.start()
        out = fn(*args, **kwargs)
        self.busy.stop(begun)
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
                 autocast: torch.dtype | None = None, accumulate: int = 1, copies_reduced: bool = False) -> None:
        """`full`: the model's layers (cuts.layers_of); `built`: the run's device mesh (default: one of pp x dp);
        `shard`: what splits the stage's layers further (tensor parallelism, fsdp over the copies) before the stage
        is made; `autocast`: the type every forward autocasts to (--precision bf16); `accumulate`: the batches whose
        gradients add up before an update (--accumulate); `copies_reduced`: whether `shard` reduces the copies'
        gradients itself (fsdp), or the pipeline averages them over dp. The example goes through the layers before
        the stage under the CPU's autocast; torch's PipelineStage (2.14) types what a stage receives and sends from
        its first forward, which runs under the device's."""
        K = place.stages
        self.place, self.device, self.microbatches = place, device, microbatches
        built = built or device_mesh(Mesh(pp=K, dp=place.replicas), device.type)
        self.pp_group, self.dp_group = built.get_group("pp"), built.get_group("dp")
        self.copies_reduced = copies_reduced
        bounds = stage_bounds(cuts, len(full))
        lo, hi = bounds[place.stage]
        self.micro = example.shape[0]  # the stage's static shapes: evaluation runs batches of micro x microbatches
        # the shape of a micro-batch where it enters this stage, and the dropout calls before it (before the stage
        # is made: a decoder's stage is the model itself, its other pieces removed)
        self.cast = lambda: cast_to(device.type, autocast)
        on_meta = any(p.is_meta for p in full.parameters())  # built without memory: laid out, then drawn
        with torch.no_grad(), GlobalBatchDropout(torch.device("cpu"), (0, 1), 0, 0, 0) as before, \
                cast_to("cpu", autocast):
            inp = example
            for layer in list(full)[:lo]:
                inp = run_layer(layer, inp)
        whole = list(whole_model(full).named_parameters())  # a shared weight once, under its first name
        tied = tied_weights(full, bounds, place.stage)
        # the stage's layers, named as in the whole model: its checkpoint parts and a whole model's file line up
        module = stage_module(full, lo, hi)
        self.param_numbers = _numbers(whole, module)  # in a whole model's optimizer
        tied_names = [n for n, p in module.named_parameters() if any(p is q for q in tied)]
        self.aliases = _aliases(whole, module, tied_names)
        self.ends = ends_group(built) if tied else None
        self.module = module if on_meta else module.to(device)  # (on the meta device: `shard` places it)
        if shard is not None:
            self.module = shard(self.module)
        held = dict(self.module.named_parameters())  # (sharding makes new parameters: found again by name)
        self.tied = [held[n] for n in tied_names]
        self.stage = _TimedStage(self.module, place.stage, K, device, input_args=(inp.to(device),),
                                 group=self.pp_group)
        self.stage.chunk_share, self.stage.chunks = (place.replica, place.replicas), microbatches
        self.stage.first_call = before.call
        # the bubble's figures, in device time read without waiting in a step (runtime/device_time.py)
        self.stage.busy, self.steps_time = DeviceTime(device), DeviceTime(device)
        # --accumulate K: each batch's loss is divided by K (the schedule divides its gradients by the
        # micro-batches, scale_grads), and step() adds each batch's gradients to those of the batches before
        self.accumulate = accumulate
        self.schedule = SCHEDULE_CLASSES[schedule](self.stage, microbatches,
                                                   loss_fn=lambda out, target: loss(out, target) / accumulate)
        self.is_first, self.is_last = place.stage == 0, place.stage == K - 1

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one batch through the pipeline; gradients accumulate in the stage,
        scaled so that they equal those of the update's mean loss (the batch's, under --accumulate 1). The last
        stage returns the batch's mean loss and the logits; the others return (None, None)."""
        begun = self.steps_time.start()
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
        self.steps_time.stop(begun)
        if not self.is_last:
            return None, None
        return torch.stack(losses).mean() * self.accumulate, logits

    def reduce_gradients(self) -> None:
        """The gradients of a weight that the first and the last stage share (GPT-2's embedding and head) added
        up between them, as one device's are; then, hybrid, each stage's averaged over the R copies of the
        pipeline (one flat all-reduce) unless fsdp reduced them already."""
        for p in self.tied:
            if p.grad is None:  # a frozen weight: still summed, so that both ends take part
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=self.ends)
        if self.place.replicas > 1 and not self.copies_reduced:
            average_gradients(self.module.parameters(), self.place.replicas, self.dp_group)

    def counted_here(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `parameters` whose gradients this stage counts in the whole model's norm: a weight the first
        and the last stage share, the first only."""
        if self.is_first or not self.tied:
            return parameters
        shared = {id(p) for p in self.tied}
        return [p for p in parameters if id(p) not in shared]

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: Any, loss: Any, flip: bool,
                 meter: Any = None) -> torch.Tensor:
        """This copy's share of the split through the schedule, forward only: the last stage's sums
        (evaluation.batch_sums'; zeros on the other stages). The stage's shapes are fixed, so the share goes in batches
        of one copy's training batch, the last one padded with zeros and its padding's outputs dropped (in
        evaluation mode every example's output is its own). The measured bubble leaves this time out (the
        schedule's setting itself up for training again, a small exchange in the next step, counts there)."""
        from ...optimization.evaluation import SUMS, batch_sums, scores

        x_all, y_all = pair
        share = eval_range(len(y_all), self.place.replica, self.place.replicas)
        size = self.micro * self.microbatches
        # as many batches on every copy (fsdp's forwards are collectives over the copies): the most any has
        batches = -(-len(eval_range(len(y_all), 0, self.place.replicas)) // size)
        sums = torch.zeros(SUMS, dtype=torch.float64, device=self.device)
        busy, was_training = self.stage.busy, self.module.training
        self.stage.busy = None
        self.module.eval()
        try:
            with torch.no_grad():
                for start in range(share.start, share.start + batches * size, size):
                    n = max(0, min(size, share.stop - start))
                    rows = slice(start, start + n) if n else slice(0, 1)  # none left: a stand-in, counted nowhere
                    x = _padded(prep.eval(x_all[rows]), size) if self.is_first else None
                    y = _padded(y_all[rows].to(self.device), size) if self.is_last else None
                    logits = self._forward(x, y)
                    if flip:  # test-time augmentation: the mean with the mirror image's outputs
                        mirrored = self._forward(x.flip(3) if x is not None else None, y)
                        logits = (scores(logits) + scores(mirrored)) / 2 if self.is_last else None
                    if self.is_last and n:
                        logits = scores(logits)
                        sums += batch_sums(logits[:n], y[:n], loss)
                        if meter is not None:  # the other stages' metrics update nothing (zeros)
                            meter.update(logits[:n], y[:n])
        finally:
            self.module.train(was_training)
            self.stage.busy = busy
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

    def bubble(self) -> dict[str, Any]:
        """Measured idle fraction of every stage (of this copy) beside the theory, (K-1)/(M+K-1) (collective)."""
        # None where no step ran (a finished run evaluated again): summary.json holds no NaN
        steps_s = self.steps_time.seconds()
        mine = 1.0 - self.stage.busy.seconds() / steps_s if steps_s else None
        idle: list[Any] = [None] * self.place.stages
        dist.all_gather_object(idle, mine, group=self.pp_group)
        mean = None if None in idle else sum(idle) / len(idle)
        return {"measured_idle_fraction": idle, "measured_mean": mean,
                "theoretical": theoretical_bubble(self.place.stages, self.microbatches)}
