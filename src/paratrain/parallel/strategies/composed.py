"""The one composition of every mesh's workers (pp, dp, fsdp, tp: parallel/mesh.py): the layers cut into
stages where pp > 1 (stages.py, at the cut points resolved before launch: pp.py), each block's heads and hidden
units split over the tp workers (DTensor's parallelize_module, by tensor_plan.py's plan), then the copies
sharded: FSDP2 over (dp, fsdp) of each stage (copies on dp alone under a pipeline: the pipeline averages their
gradients, and adds a shared weight's). Each step is a function of its dimension and does nothing where that
dimension is 1. The names tp, pipeline and hybrid (tp.py, pipeline.py) are meshes run by this class.

Every tp worker of a copy takes the same examples (batch_share is the copy's), computes the same loss and
draws the same dropout masks; one of them (tp rank 0, on the last stage) reports the loss and the evaluation's
sums, so that the figures are summed over copies as data parallelism sums them. Where the head's scores stay
split (the gpt's), the loss is computed on the shards (torch's loss_parallel): no worker gathers the vocabulary.
Checkpoints are sharded (torch.distributed.checkpoint): any mesh, and one device, reads any other's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.errors import UserError
from ...features.precision import autocast_dtype
from . import pp
from .base import Strategy

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from ...components.parts import Parts
    from ...config import TrainConfig
    from ...data import Splits
    from ...data.transforms import BatchPipeline
    from ...optimization.phases import PhaseTimer
    from ..layout import Layout


class Composed(Strategy):
    """A mesh's workers, each holding its part of the model (its stage, its tp slice, its fsdp shard)."""

    replicated = False  # each worker holds its part: every rank writes and reads its own
    lockstep = True  # every forward is a collective

    # ---- before launch: what needs the model (its plan checked, its cut points resolved) ----

    @classmethod
    def prepare(cls, cfg: TrainConfig, data: Splits, parts: Parts | None,
                layout: Layout) -> tuple[TrainConfig, Layout]:
        """The plan and the sizes checked before any process starts; a pipeline's cuts resolved."""
        from ...components.build import make_model
        from ..mesh import check_model
        from . import tensor_plan

        mesh = layout.mesh
        # built as the workers build it (on the CPU, not the meta device: a network of yours may load weights),
        # and a pipeline's cuts count its layers' costs on an example
        model = make_model(cfg, data, parts)
        if mesh.tp > 1:  # (a mesh of fsdp and pp alone splits no layer: it needs no plan)
            plan = tensor_plan.plan_of(model, cfg.tp_plan)
            check_model(mesh, tensor_plan.shape(model))  # the heads first: the size a user chose
            tensor_plan.check_splits(model, plan, mesh.tp)
        if mesh.pp == 1:
            return cfg, layout
        shared = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
        if shared and mesh.tp > 1:  # the two ends would hold the weight split two ways (the head's, the embedding's)
            raise UserError(f"--mesh {mesh.text()}: this model's embedding and head share one weight, which tp and pp "
                            "together do not split alike yet; leave tp or pp out of the mesh")
        return pp.staged(cfg, data, parts, model, layout)

    # ---- in each worker ----


    @property
    def batch_share(self) -> tuple[int, int]:
        where = self.dims().coordinates(self.ctx.rank)
        return where["dp"] * self.dims().fsdp + where["fsdp"], self.dims().copies

    def chunks(self) -> int:
        return self.cfg.microbatches if self.dims().pp > 1 else 1

    @property
    def reports(self) -> bool:
        """Whether this worker reports its copy's loss and evaluation sums (one a copy)."""
        where = self.dims().coordinates(self.ctx.rank)
        return where["tp"] == 0 and where["pp"] == self.dims().pp - 1

    def build(self, model: nn.Module, data: Splits, loss: Any) -> nn.Module:
        from ..mesh import device_mesh
        from . import tensor_plan

        self.loss, mesh = loss, self.dims()
        self.names = [n for n, _ in model.named_parameters()]  # a whole-model optimizer state's order (restore)
        plan = tensor_plan.plan_of(model, self.cfg.tp_plan) if mesh.tp > 1 else {}
        if mesh.pp > 1:  # a stage hands on whole tensors: the last one's scores gathered for the schedule's loss
            plan = {k: "colwise_rep" if v == "colwise_shard_output" else v for k, v in plan.items()}
        self.split_scores = tensor_plan.splits_output(plan)
        self.built = device_mesh(mesh, self.ctx.device.type) if self.ctx.distributed else None
        self._note_batchnorm(model)

        self._unsharded = None

        def shard(module: nn.Module) -> nn.Module:
            module = module.to(self.ctx.device)
            if mesh.tp > 1:
                module = tensor_plan.apply(module, self.built["tp"], plan)
            if mesh.fsdp > 1 or (mesh.copies > 1 and mesh.pp == 1):
                # the EMA's copy, before fsdp shards the copies (its modules refuse deepcopy): average() shards it
                self._unsharded = copy.deepcopy(module) if self.cfg.ema else None
                self._shard_copies(module)
            return module

        if mesh.pp > 1:
            self.stage = self._pipeline(model, data, loss, shard)
            self.module = self.model = self.stage.module
            return self.module
        self.module = self.model = shard(model)
        return self.module

    def _note_batchnorm(self, model: nn.Module) -> None:
        """A pipeline with --batchnorm local normalises each micro-batch: said once, where the model has BatchNorm
        (--batchnorm sync is refused before launch: pp.prepare_checks)."""
        from ...features.batchnorm import has_batchnorm

        cfg = self.cfg
        if self.dims().pp > 1 and cfg.batchnorm == "local" and self.ctx.is_main and not cfg.quiet \
                and has_batchnorm(model):
            print(f"paratrain: note: --strategy {cfg.strategy} with --batchnorm local: each stage normalises its "
                  "BatchNorm layers over one micro-batch, so the run does not equal one device", flush=True)

    def compiled_units(self) -> list[nn.Module]:
        """A stage's module where the mesh has a pipeline; else each top-level block (its tensor-parallel layers'
        redistributions traced with it, its fsdp hooks over the copies outside)."""
        from .fsdp import blocks

        return [self.module] if self.dims().pp > 1 else blocks(self.module, self.cfg.shard_modules)

    def compile(self) -> None:
        """As every strategy compiles; where a compiled unit holds collectives (tensor parallelism's; fsdp's inside a
        stage), without torch's caches of compiled graphs: such a graph holds its collectives' process group
        names, which torch 2.14's caches do not tell apart, so a warm cache handed one worker another's graph
        ("Could not resolve the process group registered under the name 19", the second run of a --mesh
        dp=2,tp=2,pp=2 --compile). Each such run compiles afresh."""
        import torch._functorch.config as functorch
        import torch._inductor.config as inductor

        mesh = self.dims()
        if mesh.tp > 1 or (mesh.pp > 1 and mesh.fsdp > 1):
            inductor.fx_graph_cache = False
            functorch.enable_autograd_cache = False
        super().compile()

    def _pipeline(self, model: nn.Module, data: Splits, loss: Any, shard: Callable) -> Any:
        from .cuts import example_batch, layers_of
        from .stages import Pipeline, StagePlace

        cfg, mesh = self.cfg, self.dims()
        micro = cfg.batch_size // mesh.copies // cfg.microbatches
        example = example_batch(cfg, data, micro)
        layers = layers_of(model, cfg.model, example, checked=True)  # (prepare checked them)
        return Pipeline(layers, self.layout.cuts, StagePlace.of(mesh, self.ctx.rank),
                        self.ctx.device, cfg.microbatches, cfg.schedule, example, self._loss_of(loss), self.built,
                        shard, autocast_dtype(cfg.precision), cfg.accumulate, copies_reduced=mesh.fsdp > 1)

    def _shard_copies(self, module: nn.Module) -> None:
        """FSDP2 over the copies (HSDP where there are whole copies too): each block, then the root."""
        from torch.distributed.fsdp import fully_shard

        from ..mesh import data_mesh
        from .fsdp import shard_units

        over = data_mesh(self.dims(), self.built)
        for unit in shard_units(module, self.cfg.shard_modules):
            fully_shard(unit, mesh=over)
        fully_shard(module, mesh=over, reshard_after_forward=False)

    def _loss_of(self, loss: Any) -> Callable:
        """The loss on split scores computed on the shards (loss_parallel), on whole ones as it is."""
        if not self.split_scores:
            return loss

        def parallel(logits: Any, y: Any) -> Any:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                return loss(logits.float(), y)

        return parallel

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.dims().pp > 1:
            loss, logits = self.stage.step(x, y)
        else:
            if self.dims().copies > 1:  # --accumulate: gradients reduce-scattered only in the last micro-batch
                self.module.set_requires_gradient_sync(sync)
            with self._autocast():
                logits = self.model(x)
            with self._parallel_loss():
                loss = self.loss(logits.float(), y)
                backward(loss)
        if loss is None:  # a pipeline's stage before the last
            return None, None
        # the step's figures read a loss and, for class scores, their argmax: a sequence's split scores stay
        # split (their shape is all that is read), so no step gathers a vocabulary's worth (collectives: all ranks)
        from ...runtime.dist import local

        loss, logits = _whole(loss), _whole(logits) if logits.dim() == 2 else local(logits)
        return (loss, logits) if self.reports else (None, None)

    def _parallel_loss(self) -> contextlib.AbstractContextManager:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.split_scores and self.dims().tp > 1 else contextlib.nullcontext()

    def agree_buffers(self, module: nn.Module) -> None:
        """Cut into stages, each stage's copies take copy 0's buffers (the stages hold different ones)."""
        from ...features.batchnorm import broadcast_buffers

        if self.dims().pp == 1:
            super().agree_buffers(module)
        elif self.dims().copies > 1:
            broadcast_buffers(module, group=self.stage.dp_group)

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        """A pipeline's: the shared weight's gradients added up between its ends, and each stage's averaged over
        its dp copies (their own parts); a phase of its own under --time-phases where no collective runs
        inside the forward and backward (allreduce_timed), else counted as compute with them."""
        if self.dims().pp > 1:
            with timer.phase("allreduce" if self.allreduce_timed else "compute"):
                self.stage.reduce_gradients()

    def clip_grad_norm(self, max_norm: float) -> None:
        mesh = self.dims()
        if mesh.pp > 1 and mesh.tp == mesh.fsdp == 1:
            self._clip_over_stages(max_norm)
        else:
            self._clip_held(max_norm)

    def _clip_over_stages(self, max_norm: float) -> None:
        """The norm over every stage's gradients (each stage's squared norm summed over its copy's stages), each
        scaled by torch's clip_grad_norm_ rule with it (every copy's gradients are averaged already)."""
        import torch
        import torch.distributed as dist
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        parameters = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p.grad for p in self.stage.counted_here(parameters)]
        squares = get_total_norm(counted).to(self.ctx.device, torch.float32).square() \
            if counted else torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        dist.all_reduce(squares, group=self.stage.pp_group)
        clip_grads_with_norm_(parameters, max_norm, squares.sqrt())

    def _clip_held(self, max_norm: float) -> None:
        """torch's clip_grad_norm_ rule over the whole model's gradients, which here are DTensors (split by the
        plan, sharded over the copies, on several meshes) and plain tensors (the layers the plan leaves whole)
        that no one norm takes together. Each worker sums the squares of what it holds, each divided by the
        workers that hold the same elements (a copy's other stages hold none of them); one all-reduce of those
        sums gives every worker the same total, so every worker scales alike. (A DTensor's own norm, made whole
        over a 2-D mesh, is two all-reduces whose order may differ between ranks.)"""
        import math

        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate

        stage_workers = self.ctx.world_size // self.dims().pp
        held = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in held]
        squares = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for grad in (p.grad for p in (held if self.dims().pp == 1 else self.stage.counted_here(held))):
            if isinstance(grad, DTensor):
                mesh = grad.device_mesh
                holders = stage_workers // mesh.size() * math.prod(
                    mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate))
                grad = grad.to_local()
            else:
                holders = stage_workers
            squares += grad.double().square().sum() / holders
        if self.ctx.distributed:
            dist.all_reduce(squares)
        scale = min(max_norm / (math.sqrt(float(squares)) + 1e-6), 1.0)
        for grad in grads:
            grad.mul_(scale)

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, batch_size: int, loss: Any,
                 flip: bool, meter: Any = None) -> tuple[float, float]:
        """Each copy evaluates its share (every tp worker of it alike: each forward is a collective), and one
        worker a copy counts it."""
        from ...optimization.evaluation import evaluate_share, totals

        if self.dims().pp > 1:
            sums = self.stage.evaluate(pair, prep, self._loss_of(loss), flip, meter)
        else:
            which, of = self.batch_share
            view = dataclasses.replace(self.ctx, rank=which, world_size=of)
            sums = evaluate_share(_Gathered(self.module), pair, prep, view, batch_size, loss, flip, meter)
        return totals(sums if self.reports else sums.zero_(), self.ctx)

    def average(self, decay: float) -> AveragedModel:
        if self._unsharded is None:
            return super().average(decay)
        unsharded, self._unsharded = self._unsharded, None
        return self._average_sharded(unsharded, decay, self._shard_copies)

    def evaluate_average(self, ema: AveragedModel, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline,
                         batch_size: int, loss: Any, flip: bool, meter: Any = None) -> tuple[float, float]:
        """The weight average through `evaluate` (its scores split as the model's: its own loss)."""
        return self._evaluate_average_in_place(ema, pair, prep, batch_size, loss, flip, meter)

    def aliases(self) -> dict[str, str]:
        return self.stage.aliases if self.dims().pp > 1 else {}

    def load(self, saved: dict) -> None:
        if "sharded" in saved:
            super().load(saved)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        names = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        mine = {k: v for k, v in saved["model"].items() if k in names}  # a stage's part of the whole model
        missing = [n for n in self.module.state_dict() if n not in mine]
        if missing:
            raise UserError(f"the checkpoint in {self.cfg.resume or self.cfg.out} has no {missing[0]} (and "
                            f"{len(missing) - 1} more of this worker's tensors): it is another model's; start a "
                            "new run, or resume with the options of the run that wrote it")
        set_model_state_dict(self.module, mine, options=StateDictOptions(full_state_dict=True, strict=False))

    def restore(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict) -> None:
        if "sharded" in saved:
            super().restore(optimizer, ema, saved)  # the weight average's part too, split as the weights
            return
        # an earlier release's whole-model file (ddp's, one device's): its state by parameter number, named here
        # as the whole model names them, of which this worker loads what it holds (split by set_optimizer_state_dict)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = saved["optimizer"]
        if len(full["param_groups"]) != 1:
            raise UserError(f"this checkpoint's optimizer has several parameter groups; --strategy {self.cfg.strategy} "
                            "cannot read it: carry it on under its own strategy")
        # the whole model's parameter numbers of what this worker holds (a stage's by number: its half of a shared
        # weight has the number of the model's first name)
        mine = [n for n, _ in self.module.named_parameters()]
        at = {n: i for i, n in enumerate(self.names)}
        numbers = self.stage.param_numbers if self.dims().pp > 1 else [at[n] for n in mine]
        named = dict(zip(numbers, mine, strict=True))
        state = {named[int(i)]: v for i, v in full["state"].items() if int(i) in named}
        group = {**full["param_groups"][0], "params": mine}
        set_optimizer_state_dict(self.module, optimizer, {"state": state, "param_groups": [group]},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        if ema is not None and "ema_model" in saved:  # the whole average's, "module."-named: what this worker holds
            held = dict(ema.module.state_dict())
            average = {k.removeprefix("module."): v for k, v in saved["ema_model"].items()}
            set_model_state_dict(ema.module, {k: v for k, v in average.items() if k in held},
                                 options=StateDictOptions(full_state_dict=True, strict=False))

    def summary(self) -> dict[str, Any]:
        pipeline = None
        if self.dims().pp > 1:
            pipeline = {"stages": self.dims().pp, "microbatches": self.cfg.microbatches,
                        "schedule": self.cfg.schedule, "cuts": ",".join(map(str, self.layout.cuts)),
                        "bubble": self.stage.bubble()}
        return {**super().summary(), "pipeline": pipeline}


def _whole(t: Any) -> Any:
    """A DTensor as the plain tensor it stands for (split scores gathered: the step's metrics read them)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Gathered:
    """The model for evaluation: its scores whole (gathered where the head leaves them split)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, x: Any) -> Any:
        return _whole(self.module(x))
