"""The one composition of every mesh's workers (pp, dp, fsdp, tp: parallel/mesh.py): the layers cut into
stages where pp > 1 (stages.py, at the cut points resolved before launch: pp.py), each block's heads and hidden
units split over the tp workers (DTensor's parallelize_module, by tensor_plan.py's plan), then the copies
sharded: FSDP2 over (dp, fsdp) of each stage (copies on dp alone under a pipeline: the pipeline averages their
gradients, and adds a shared weight's), or, whole copies, DDP's (dp.py, once their state is restored). Each
step is a function of its dimension and does nothing where that dimension is 1. Every name --strategy takes but
the tower's is a mesh run by this class (names.py).

Every tp worker of a copy takes the same examples (batch_share is the copy's), computes the same loss and
draws the same dropout masks; one of them (tp rank 0, on the last stage) reports the loss and the evaluation's
sums, so that the figures are summed over copies as data parallelism sums them. Where the head's scores stay
split (the gpt's), the loss is computed on the shards (torch's loss_parallel): no worker gathers the vocabulary.
Checkpoints are step folders (torch.distributed.checkpoint), each worker writing its part (rank 0 alone for whole
copies): any mesh, and one device, reads any other's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.errors import UserError
from ...features.precision import autocast_dtype
from .base import Strategy
from .pp import staged

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
        from torch import nn

        from ...components.build import make_empty, make_model
        from ..mesh import check_adapters, check_model
        from .tensor_plan import check_splits, plan_of, shape

        mesh = layout.mesh
        check_adapters(mesh, cfg.lora, cfg.lora_dropout)
        if mesh.tp == mesh.pp == 1:  # no layer split, no cut: nothing to check on the model
            return cfg, layout
        # built as the workers build it (on the meta device where it can be: its shapes are what is checked, and a
        # pipeline's cuts count its layers' costs on an example's shapes); a pipeline of a network that is not a
        # sequence is checked against its forward, which needs its weights
        model, initial, _ = make_empty(cfg, data, parts)
        if initial is not None and mesh.pp > 1 and not isinstance(model, nn.Sequential):
            model = make_model(cfg, data, parts)
        if mesh.tp > 1:  # (a mesh of fsdp and pp alone splits no layer: it needs no plan)
            plan = plan_of(model, cfg.tp_plan)
            # the heads first: the size a user chose (the gpt's by its flags)
            check_model(mesh, shape(model), {"heads": "--heads" + ("" if cfg.heads else " (the default is --width / "
                                                                   "64)"), "width": "--width"}
                        if cfg.model == "gpt" else None)
            check_splits(model, plan, mesh.tp)
        if mesh.pp == 1:
            return cfg, layout
        shared = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
        if shared and mesh.tp > 1:  # the two ends would hold the weight split two ways (the head's, the embedding's)
            raise UserError(f"--mesh {mesh.text()}: this model's embedding and head share one weight, which tp and pp "
                            "together do not split alike yet; leave tp or pp out of the mesh")
        return staged(cfg, data, parts, model, layout)

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
        from ...components.initial import placed
        from ..mesh import device_mesh
        from .tensor_plan import apply, plan_of, splits_output

        self.loss, mesh = loss, self.dims()
        self.names = [n for n, _ in model.named_parameters()]  # a whole-model optimizer state's order (restore)
        plan = plan_of(model, self.cfg.tp_plan) if mesh.tp > 1 else {}
        if mesh.pp > 1:  # a stage hands on whole tensors: the last one's scores gathered for the schedule's loss
            plan = {k: "colwise_rep" if v == "colwise_shard_output" else v for k, v in plan.items()}
        self.split_scores = splits_output(plan)
        # (whole copies are DDP's, over the default group: no mesh to build)
        self.built = device_mesh(mesh, self.ctx.device.type) if self.ctx.distributed and not self.replicated \
            else None
        self._notes(model)
        self._unsharded, self.synced_bn, self._last_bucket = None, False, None

        def shard(module: nn.Module) -> nn.Module:
            # laid out on the meta device, then each worker draws its part of the weights (placed); a model built
            # whole is moved first where tp splits it (fully_shard moves each shard to the device itself)
            if self.initial is None and (mesh.tp > 1 or not self.sharded):
                module = module.to(self.ctx.device)
            if mesh.tp > 1:
                module = apply(module, self.built["tp"], plan)
            module = self._synchronised(module)
            if self.sharded:  # the EMA's copy (on the meta device), before fsdp shards the copies: average() shards it
                self._unsharded = copy.deepcopy(module) if self.cfg.ema else None
                self._shard_copies(module)
            if self.initial is None:
                return module
            # (FSDP2 keeps an offloaded shard in CPU memory: it must be made there)
            return placed(module, self.initial, "cpu" if self.cfg.cpu_offload else self.ctx.device)

        if mesh.pp > 1:
            self.stage = self._pipeline(model, data, loss, shard)
            self.module = self.model = self.stage.module
            return self.module
        self.module = self.model = shard(model)
        return self.module

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the copies: over fsdp, and over dp where no pipeline averages the copies itself
        and the copies are not whole (`replicated`: DDP's, wrap)."""
        mesh = self.dims()
        return mesh.fsdp > 1 or (mesh.copies > 1 and mesh.pp == 1 and not self.replicated)

    @property
    def _cast_by_fsdp(self) -> bool:
        """Whether FSDP2's policy casts the gathered weights (--precision bf16 on fsdp and hsdp alone); with tp or
        pp, the forward runs under autocast with fp32 weights, as one device's does."""
        mesh = self.dims()
        return self.sharded and mesh.tp == mesh.pp == 1 and self.cfg.precision in ("bf16", "float8")

    def _synchronised(self, module: nn.Module) -> nn.Module:
        """--batchnorm sync over the copies of a model that no pipeline cuts and no tp splits (each BatchNorm layer
        normalising over the global batch, as one device would; a tp worker would count its copy's examples again)."""
        from ...features.batchnorm import has_batchnorm, synchronise

        mesh = self.dims()
        if self.ctx.distributed and mesh.pp == mesh.tp == 1 and self.cfg.batchnorm == "sync" and has_batchnorm(module):
            self.synced_bn = True
            return synchronise(module, self.ctx.device)
        return module

    def _notes(self, model: nn.Module) -> None:
        """What the run's first worker says of its layout, once: a layout that splits a network which cannot be built
        on the meta device (each worker builds it whole first: its peak holds it), and a pipeline with --batchnorm
        local, which normalises each micro-batch (--batchnorm sync is refused before launch: pp.prepare_checks)."""
        from ...features.batchnorm import has_batchnorm

        cfg, mesh = self.cfg, self.dims()
        if not self.ctx.is_main or cfg.quiet:
            return
        if self.initial is None and (self.sharded or mesh.splits_model):
            print(f"paratrain: note: each worker builds the whole model before taking its part, as {self.drawn_whole}",
                  flush=True)
        if mesh.pp > 1 and cfg.batchnorm == "local" and has_batchnorm(model):
            print(f"paratrain: note: --strategy {cfg.strategy} with --batchnorm local: each stage normalises its "
                  "BatchNorm layers over one micro-batch, so the run does not equal one device", flush=True)

    def compiled_units(self) -> list[nn.Module]:
        """A stage's module where the mesh has a pipeline; else, where the model is split or sharded, each block
        (its tensor-parallel layers' redistributions traced with it, its fsdp hooks, which gather and free its
        weights, outside, as torchtitan compiles); one worker's plain model whole."""
        from .fsdp import blocks

        if self.dims().pp > 1 or not (self.sharded or self.dims().tp > 1):
            return [self.module]
        return blocks(self.module, self.cfg.shard_modules)

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
        """FSDP2 over the copies (HSDP where there are whole copies too): each block (--shard-modules, or the
        model's), then the root; a shard held in CPU memory under --cpu-offload."""
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from ..mesh import data_mesh
        from .fsdp import shard_units

        cfg, options = self.cfg, {"mesh": data_mesh(self.dims(), self.built)}
        if self._cast_by_fsdp:  # weights gathered in bf16, gradients reduced in fp32
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        units = [fully_shard(unit, reshard_after_forward=cfg.reshard_after_forward, **options)
                 for unit in shard_units(module, cfg.shard_modules)]
        # the root's own weights are needed again at once by the backward: never freed after its forward
        units.append(fully_shard(module, reshard_after_forward=False, **options))
        if self.ctx.device.type == "cpu":
            # A CPU gathers a block's weights as its backward starts, not during the block after it's (FSDP2's
            # fetch ahead, for a GPU's overlap): one block's weights fewer at a worker's peak, and no slower on a
            # CPU (benchmarks.md: 'Models built on the meta device'). A block told to fetch itself ahead fetches
            # nothing (its weights are gathered by then).
            for unit in units:
                first = unit[0] if isinstance(unit, list) else unit
                first.set_modules_to_backward_prefetch([first])

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
            if self.sharded:  # --accumulate: gradients reduce-scattered only in the last micro-batch
                self.module.set_requires_gradient_sync(sync)
            # DDP all-reduces in the backward; no_sync leaves the gradients to accumulate locally
            with self.model.no_sync() if self.wrapped and not sync else contextlib.nullcontext():
                with self._autocast():
                    logits = self.model(x)
                with self._parallel_loss():
                    loss = self.loss(logits.float(), y)
                    backward(loss)
        if loss is None:  # a pipeline's stage before the last
            return None, None
        # the step's figures read a loss and, for class scores, their argmax: a sequence's split scores stay
        # split (their shape is all that is read), so no step gathers a vocabulary's worth (collectives: all ranks)
        from ...runtime.dist import local, whole

        loss, logits = whole(loss), whole(logits) if logits.dim() == 2 else local(logits)
        return (loss, logits) if self.reports else (None, None)

    @property
    def wrapped(self) -> bool:
        """Whether DDP runs the whole copies (wrap)."""
        return self.replicated and self.ctx.distributed

    def wrap(self) -> None:
        """Whole copies on several workers: DDP (it broadcasts rank 0's weights, then averages every gradient);
        the bare model on one worker, where an all-reduce would only cost time."""
        if self.wrapped:
            from .dp import wrap

            self.model, self._last_bucket = wrap(self.module, self.ctx, self.synced_bn)

    def gradients_ready_at(self) -> float | None:
        last = self._last_bucket  # DDP's hook, where it runs on the CPU
        if last is None:
            return None
        ready, last.ready = last.ready, None
        return ready

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._cast_by_fsdp else super()._autocast()

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
        elif self.wrapped:
            timer.allreduce_gradients(self.module)  # --time-phases: the all-reduce DDP was told to skip

    def clip_grad_norm(self, max_norm: float) -> None:
        from .clipping import clip_grad_norm

        clip_grad_norm(self.module, max_norm, self.dims(), self.ctx, getattr(self, "stage", None))

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, batch_size: int, loss: Any,
                 flip: bool, meter: Any = None) -> tuple[float, float]:
        """Each copy evaluates its share (every tp worker of it alike; in lockstep where each forward is a
        collective), under the run's autocast as it trains, and one worker a copy counts it."""
        from ...optimization.evaluation import WholeScores, evaluate_share, totals

        if self.dims().pp > 1:
            sums = self.stage.evaluate(pair, prep, self._loss_of(loss), flip, meter)
        else:
            which, of = self.batch_share
            view = dataclasses.replace(self.ctx, rank=which, world_size=of)
            with self._autocast():
                sums = evaluate_share(WholeScores(self.module), pair, prep, view, batch_size, loss, flip, meter,
                                      lockstep=self.lockstep)
        return totals(sums if self.reports else sums.zero_(), self.ctx)

    def average(self, decay: float) -> AveragedModel:
        if self._unsharded is None:
            return super().average(decay)
        unsharded, self._unsharded = self._unsharded, None
        return self._average_sharded(unsharded, decay, self._shard_copies)

    def evaluate_average(self, ema: AveragedModel, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline,
                         batch_size: int, loss: Any, flip: bool, meter: Any = None) -> tuple[float, float]:
        """The weight average through `evaluate` where a pipeline or tensor parallelism runs it (through the
        schedule; its scores split as the model's); else the average, sharded as the model is, evaluates itself."""
        if self.dims().pp == self.dims().tp == 1:
            return super().evaluate_average(ema, pair, prep, batch_size, loss, flip, meter)
        return self._evaluate_average_in_place(ema, pair, prep, batch_size, loss, flip, meter)

    def aliases(self) -> dict[str, str]:
        return self.stage.aliases if self.dims().pp > 1 else {}

    def load(self, saved: dict) -> None:
        if "sharded" in saved or self.replicated:  # (a whole copy: the whole file, checked to fit)
            super().load(saved)
            return
        if not self.reads_whole_files:  # (a worker that fell back to one, past a damaged step folder)
            from ...checkpoint.manager import whole_file_not_read

            raise whole_file_not_read(self.cfg.resume or self.cfg.out, self.cfg.strategy)
        from .whole_files import load_part

        load_part(self.module, saved, self.cfg.resume or self.cfg.out, self.cfg.to_dict())

    def restore(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict) -> None:
        if "sharded" in saved or self.replicated:  # (a whole copy takes a whole file's state as it is)
            super().restore(optimizer, ema, saved)  # the weight average's part too, split as the weights
            return
        # an earlier release's whole-model file (ddp's, one device's): of which this worker loads what it holds
        from .whole_files import restore_part

        at = {n: i for i, n in enumerate(self.names)}
        numbers = self.stage.param_numbers if self.dims().pp > 1 else [at[n] for n, _ in self.module.named_parameters()]
        restore_part(self.module, optimizer, ema, saved, numbers, self.cfg.strategy)

    def summary(self) -> dict[str, Any]:
        pipeline = None
        if self.dims().pp > 1:
            pipeline = {"stages": self.dims().pp, "microbatches": self.cfg.microbatches,
                        "schedule": self.cfg.schedule, "cuts": ",".join(map(str, self.layout.cuts)),
                        "bubble": self.stage.bubble()}
        return {**super().summary(), "pipeline": pipeline}
