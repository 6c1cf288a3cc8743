"""What a strategy is: the rules for spreading one training over the workers, in the order a run needs them.

Before launch (classmethods, in the launching process, without torch; runplan.make calls them): `check` the
options, fill in `defaults`, `arrange` the batch split over the `copies` of the model, `prepare` what needs the
data (a pipeline's cuts). What the workers must know of these decisions is the plan's `layout`, given to
the instance. In each worker (an instance): `build` the part of the model this worker trains (from a model built on
the meta device: its part of the initial weights drawn then), `load` a checkpoint's weights into it and `restore`
its optimizer state, `wrap` it; every step `forward_backward`, `reduce_gradients`, `clip_grad_norm`; and `save`,
`evaluate` and `summary` for checkpoints, evaluation and summary.json.

The hooks leave room for a strategy whose workers do not hold the whole model: `build` returns whatever
module this worker updates (a pipeline stage; sharded tensors under FSDP2), `average` makes the weight average
(--ema) of it, `save` is one for every layout (every rank writes its own part of a step folder through
torch.distributed.checkpoint), `load`/`restore` read what this worker holds of one (or of an earlier release's
whole-model file), and `evaluate`/`clip_grad_norm` run or reduce across workers where needed (no strategy gathers
the whole model, but for the weight histograms: `whole_parameters`). Every mesh's workers run through one
subclass (composed.py), the tower through its own (tower.py); a new name for a mesh is a class in names.py (its
rules before launch) and its name in config.STRATEGIES.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from ...core.errors import UserError
from ...features.precision import autocast, autocast_dtype

if TYPE_CHECKING:  # torch is imported where a worker needs it: strategies.checked calls `check` without it
    import torch
    from torch import nn
    from torch.optim.swa_utils import AveragedModel

    from ...checkpoint.manager import RunCheckpoints
    from ...components.initial import Initial
    from ...components.parts import Parts
    from ...components.pretrained import Pretrained
    from ...config import TrainConfig
    from ...data import Splits
    from ...data.transforms import BatchPipeline
    from ...optimization.phases import PhaseTimer
    from ...runtime.devices import Hardware
    from ...runtime.dist import DistContext
    from ...runtime.env import Environment
    from ..layout import Layout
    from ..mesh import Mesh

# The options only some layouts take (those in their `options`), as a user meets them when another layout is given
FOREIGN = {"shard_modules": ("--shard-modules", "--strategy fsdp or hsdp"),
           "shard_size": ("--shard-size", "--strategy hsdp"),
           "reshard_after_forward": ("--no-reshard-after-forward", "--strategy fsdp or hsdp"),
           "cpu_offload": ("--cpu-offload", "--strategy fsdp or hsdp"),
           "tp_plan": ("--tp-plan", "--strategy tp (or a --mesh with tp)")}


class Strategy:
    name: ClassVar[str]
    unit: ClassVar[str] = "workers"  # what the global batch is split over, for messages
    pipelined: ClassVar[bool] = False  # cuts the layers into stages (--stages, --split, --print-split)
    lockstep: ClassVar[bool] = False  # every forward is a collective: evaluation runs as many on every worker
    # --time-phases: the gradients' reduction is a phase of its own (DDP's is moved out of the backward); where
    # it runs inside the backward (FSDP's reduce-scatter, tensor parallelism's collectives), it counts as compute
    allreduce_timed: ClassVar[bool] = True
    # What a layout allows or needs, declared here and asked by the code outside parallel/ (which never compares
    # a layout's name): the options it takes of those only some layouts take (FOREIGN, and --mesh), ...
    options: ClassVar[tuple[str, ...]] = ()
    one_process: ClassVar[bool] = False  # one process drives every device (no workers forked)
    auto_devices: ClassVar[bool] = False  # --devices auto on CPUs measures 1 worker against N (autodevices.py)
    channels_last: ClassVar[bool] = False  # --memory-format channels_last (auto: for convolutional networks)
    reads_whole_files: ClassVar[bool] = True  # carries on from an earlier release's whole-model checkpoint file
    # every worker holds the same whole model (ddp's replicas; the tower's one process): rank 0 writes each step
    # folder alone, on its node's disk (as before one format, when it wrote one file), and each worker reads it
    # whole, without the others (one that lacks it, on another node, is sent it: checkpoint/files.py's agree)
    replicated: ClassVar[bool] = True
    # a worker's own part of a step can be timed apart from its wait for the others (gradients_ready_at): the
    # waits at the step's all-reduce are measured on the CPU (training/stragglers.py)
    waits_measurable: ClassVar[bool] = False
    initial: Initial | Pretrained | None = None  # a meta-built model's weights (None: as drawn_whole says)
    drawn_whole: str = ""

    # ---- before launch, in the launching process ----

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        """Raise UserError for options this strategy cannot take (strategies.checked calls it)."""
        if cfg.stages is not None:
            raise UserError(f"--stages is for --strategy pipeline or hybrid, not {cfg.strategy}")
        if cfg.memory_format == "channels_last" and not cls.channels_last:
            raise UserError(f"--memory-format channels_last is available with --strategy ddp, not {cfg.strategy}; "
                            "leave it out")

    @classmethod
    def check_foreign(cls, cfg: TrainConfig) -> None:
        """Raise UserError for another strategy's own options (every strategy's, whatever its `check`)."""
        from ...config import FIELDS

        for option, (flag, takers) in FOREIGN.items():
            if getattr(cfg, option) != FIELDS[option].default and option not in cls.options:
                raise UserError(f"{flag} is for {takers}, not {cfg.strategy}")

    @classmethod
    def least_devices(cls, cfg: TrainConfig) -> int:
        """The fewest workers this layout runs on (a search's trial gets at least these)."""
        return 1

    @classmethod
    def defaults(cls, cfg: TrainConfig) -> TrainConfig:
        """The configuration with this strategy's defaults filled in, before the devices are resolved."""
        return cfg

    @classmethod
    def copies(cls, cfg: TrainConfig, workers: int) -> int:
        """Into how many shares the global batch splits on `workers` workers."""
        return workers

    @classmethod
    def arrange(cls, cfg: TrainConfig, hardware: Hardware,
                env: Environment) -> tuple[TrainConfig, Hardware, Layout]:
        """The batch split over the workers, checked once before any process starts; the processes to
        start; and the run's layout (parallel/layout.py: what its workers read from the plan)."""
        from ..layout import Layout

        copies = cls.copies(cfg, hardware.workers)
        if cfg.batch_per_worker:
            cfg = cfg.replace(batch_size=cfg.batch_per_worker * copies)
        if cfg.batch_size % copies:
            raise UserError(f"--batch-size {cfg.batch_size} does not split evenly over {copies} {cls.unit}; "
                            f"use a multiple of {copies}")
        return cfg, hardware, Layout(cfg.strategy, cls.mesh_of(cfg, hardware.workers, env))

    @classmethod
    def mesh_of(cls, cfg: TrainConfig, workers: int, env: Environment) -> Mesh:
        """The mesh this strategy runs `workers` on (its shorthand: parallel/mesh.py's `of`)."""
        from ..mesh import of

        return of(cfg.strategy, workers, cfg.stages, cfg.shard_size)

    @classmethod
    def prepare(cls, cfg: TrainConfig, data: Splits, parts: Parts | None,
                layout: Layout) -> tuple[TrainConfig, Layout]:
        """What is decided once the data is loaded, for every worker alike: the resolved configuration, and
        the layout with what it adds (a pipeline's cuts)."""
        return cfg, layout

    # ---- in each worker ----

    def __init__(self, ctx: DistContext, cfg: TrainConfig, layout: Layout | None = None) -> None:
        from ..layout import Layout

        self.ctx, self.cfg, self.layout = ctx, cfg, layout or Layout(cfg.strategy)  # the plan's, in a run
        self.module: Any = None  # what this worker trains (set by build)
        self.model: Any = None  # what it calls: the module, or its wrapper (set by build, wrap)
        self.loss: Any = None

    def gradients_ready_at(self) -> float | None:
        """When (time.perf_counter) this worker's own gradients of the step were ready, before it waited for
        the others' (where the strategy can tell: data parallel on the CPU); None elsewhere."""
        return None

    def chunks(self) -> int:
        """Into how many micro-batches a pipeline's stages cut this worker's share of a batch (1: no pipeline)."""
        return self.cfg.microbatches if self.pipelined else 1

    @property
    def batch_share(self) -> tuple[int, int]:
        """(which, of how many): this worker's share of every global batch."""
        return self.ctx.rank, self.ctx.world_size

    def build(self, model: nn.Module, data: Splits, loss: Any) -> nn.Module:
        """The module whose parameters this worker updates, on its device (the optimizer is built over it).
        `model` is the whole model, on the meta device (its initial weights in `initial`) or, built whole, on the
        CPU (`load` then loads a checkpoint)."""
        from ...components.initial import placed

        self.loss = loss
        self.module = self.model = placed(model, self.initial, self.ctx.device)
        return self.module

    def load(self, saved: dict) -> None:
        """Load a checkpoint's weights into what this worker trains (after `build`): a step folder, of which this
        worker reads what it holds, or an earlier release's whole-model file."""
        from ...checkpoint import files as checkpoint

        if "sharded" in saved:
            self._read_sharded_weights(saved)
        else:
            checkpoint.load_weights(self.module, saved, self.cfg.resume, self.cfg.to_dict())

    def average(self, decay: float) -> AveragedModel:
        """The weight average (--ema) of what this worker trains (after `load`: it starts from those weights)."""
        from ...optimization.optim import make_ema

        return make_ema(self.module, decay)

    def _average_sharded(self, unsharded: nn.Module, decay: float, shard: Callable[[nn.Module], Any]) -> AveragedModel:
        """The weight average of a sharded model, made from the copy kept before sharding and sharded alike."""
        from ...components.initial import copy_into
        from ...optimization.optim import make_ema

        ema = make_ema(unsharded, decay)
        shard(ema.module)
        if self.initial is not None:
            copy_into(ema.module, self.module)
        return ema

    def restore(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict) -> None:
        """Load a checkpoint's optimizer state into this worker's optimizer, and its weight average into
        `ema` (this worker's part of a step folder's, or an earlier release's whole-model file's)."""
        if "sharded" in saved:
            self._read_sharded_state(optimizer, ema, saved)
            return
        optimizer.load_state_dict(saved["optimizer"])
        if ema is not None and "ema_model" in saved:
            ema.module.load_state_dict(saved["ema_model"])

    # ---- sharded checkpoints (checkpoint/dcp.py): every rank writes and reads its own part, named as in the whole
    # model; the optimizer state flattened to one key per parameter ("state.NAME.exp_avg", "param_groups.NAME.lr")
    # so that ranks holding different parameters (a pipeline's stages) write parts that never collide ----

    def aliases(self) -> dict[str, str]:
        """{this worker's name: the whole model's} of a weight it holds under another name than the model's first
        (a pipeline's last stage's half of a shared embedding and head): read under the model's name."""
        return {}

    def _read_sharded_weights(self, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from ...checkpoint import dcp
        from ...checkpoint import files as checkpoint

        into = {"model": dcp.renamed(get_model_state_dict(self.module), self.aliases())}
        shapes = {k: v.shape for k, v in into["model"].items()}
        held = ({k: v.shape for k, v in saved["model"].items()} if "model" in saved  # sent whole (files.agree)
                else dcp.shapes_of(saved["sharded"], "model"))
        whole = self.replicated and not self.aliases()  # this worker holds every weight, by the model's names
        if detail := dcp.misfit(held, shapes, whole):
            raise checkpoint.not_fitting(saved, self.cfg.resume, self.cfg.to_dict(), detail)
        self._read_step_folder(saved, into)
        set_model_state_dict(self.module, dcp.renamed(into["model"], self.aliases(), back=True))

    def _read_step_folder(self, saved: dict, into: dict[str, Any]) -> None:
        """Fill `into` ({part: {name: tensor or value}}) with the step folder's: from this worker's disk (each worker
        alone where it holds the whole model: `replicated`), or from what another worker sent (files.agree)."""
        from ...checkpoint import dcp

        if "model" in saved:
            for part, entries in into.items():
                into[part] = {k: saved[part][k] for k in entries}
        else:
            dcp.read(saved["sharded"], into, self.ctx.distributed and not self.replicated)

    def _read_sharded_state(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        from ...checkpoint import dcp

        options, names = dcp.state_dict_options(saved.get("flat_optimizer", True)), self.aliases()
        into: dict[str, Any] = {"optimizer": get_optimizer_state_dict(self.module, optimizer, options=options)}
        if ema is not None and saved.get("ema_n_averaged") is not None:
            into["ema_model"] = ema.module.state_dict()
        into = {k: dcp.renamed(v, names) for k, v in into.items()}
        self._read_step_folder(saved, into)
        into = {k: dcp.renamed(v, names, back=True) for k, v in into.items()}
        set_optimizer_state_dict(self.module, optimizer, into["optimizer"], options=options)
        if "ema_model" in into:
            ema.module.load_state_dict(into["ema_model"])

    def compiled_units(self) -> list[nn.Module]:
        """What --compile compiles, each on its own: here the whole model (wrapped by nothing that runs inside its
        forward); a sharded model's blocks (fsdp, tp), a pipeline's stage."""
        return [self.module]

    def compile(self) -> None:
        """--compile: torch.compile the forward of each of `compiled_units()`, in place. A unit's own hooks, where
        fsdp gathers a block's weights, stay outside the compiled code (as torchtitan compiles each block, not the
        sharded whole); the hooks of the layers inside it (tensor parallelism's redistributions) are compiled
        with it. The parameters' names and state_dict keys are unchanged."""
        import torch

        for unit in self.compiled_units():
            unit.forward = torch.compile(unit.forward)

    def wrap(self) -> None:
        """Wrap the module for training, once its state is restored."""

    def agree_buffers(self, module: nn.Module) -> None:
        """Give every worker rank 0's buffers (BatchNorm's running statistics) before an evaluation or a
        checkpoint, so that the split evaluation, the summary and the saved network are one network
        (collective; none where the model has no buffers)."""
        from ...features.batchnorm import broadcast_buffers

        if self.ctx.distributed:
            broadcast_buffers(module)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.ctx.device.type, autocast_dtype(self.cfg.precision))

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, sync: bool,
                         backward: Callable[[Any], None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One micro-batch: the mean loss and logits (None where this worker computes no loss). `sync`:
        whether the gradients are reduced in this backward; `backward(loss)` scales and back-propagates."""
        with self._autocast():
            logits = self.model(x)
        loss = self.loss(logits.float(), y)
        backward(loss)
        return loss, logits

    def reduce_gradients(self, timer: PhaseTimer) -> None:
        """Whatever gradient reduction forward_backward left to do before the update."""

    def whole_parameters(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, weight, gradient) of each parameter this worker trains, whole (--histogram-every), one at a
        time (a sharded model is not gathered at once): a sharded tensor (a DTensor: fsdp, tp) is gathered, a
        collective that every worker of the run joins, so every worker iterates to the end. A pipeline's
        stage gives its own layers."""
        from torch.distributed.tensor import DTensor

        def whole(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if isinstance(t, DTensor) else t

        for name, p in self.module.named_parameters():
            yield name, whole(p.detach()), None if p.grad is None else whole(p.grad.detach())

    def clip_grad_norm(self, max_norm: float) -> None:
        """Clip the gradients to a total norm of `max_norm` (here every worker holds every gradient)."""
        from torch.nn.utils import clip_grad_norm_

        clip_grad_norm_(self.module.parameters(), max_norm)

    def evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, batch_size: int, loss: Any,
                 flip: bool, meter: Any = None) -> tuple[float, float]:
        """Accuracy and mean loss of the model being trained over a whole split (collective: every worker
        evaluates its share, the sums are all-reduced), its forwards under the run's autocast; `meter`
        (metrics.Meter) sees every batch."""
        from ...optimization.evaluation import evaluate

        with self._autocast():
            return evaluate(self.module, pair, prep, self.ctx, batch_size, loss, flip, self.lockstep, meter)

    def evaluate_average(self, ema: AveragedModel, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline,
                         batch_size: int, loss: Any, flip: bool, meter: Any = None) -> tuple[float, float]:
        """`evaluate` of the weight average (--ema): here the average is a whole model of its own."""
        from ...optimization.evaluation import evaluate

        with self._autocast():
            return evaluate(ema.module, pair, prep, self.ctx, batch_size, loss, flip, self.lockstep, meter)

    def _evaluate_average_in_place(self, ema: AveragedModel, pair: tuple[torch.Tensor, torch.Tensor],
                                   prep: BatchPipeline, batch_size: int, loss: Any, flip: bool,
                                   meter: Any = None) -> tuple[float, float]:
        """`evaluate_average` where the average cannot evaluate as a model of its own (a pipeline's stage
        evaluates through the schedule, tensor parallelism's split scores through its own loss): the average's
        weights in the module for the while, through this strategy's `evaluate`."""
        kept = {k: v.clone() for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(ema.module.state_dict())
        try:
            return self.evaluate(pair, prep, batch_size, loss, flip, meter)
        finally:
            self.module.load_state_dict(kept)

    def save(self, optimizer: torch.optim.Optimizer, ema: AveragedModel | None,
             extras: Callable[[], dict[str, Any]], checkpoints: RunCheckpoints, step: int, keep: int) -> None:
        """Write a checkpoint, in the one format of every layout (checkpoint/dcp.py's step folder): every rank
        writes its part of the weights, optimizer state and weight average, and rank 0 adds `extras()` (scheduler,
        step, config; built on rank 0 only). No rank gathers the whole model; where every worker holds it whole
        (`replicated`), rank 0 writes it alone."""
        import dataclasses

        from torch.distributed.checkpoint.state_dict import get_state_dict

        from ...checkpoint import dcp

        if self.replicated and not self.ctx.is_main:
            return
        weights, optimizer_state = get_state_dict(self.module, optimizer, options=dcp.state_dict_options())
        tensors = {"model": weights, "optimizer": optimizer_state}
        if ema is not None:
            tensors["ema_model"] = ema.module.state_dict()
        # replicated: rank 0 as a group of its own
        writers = dataclasses.replace(self.ctx, rank=0, world_size=1, backend=None) if self.replicated else self.ctx
        checkpoints.save_sharded(writers, tensors, extras, step, keep)

    def dims(self) -> Mesh:
        """The run's mesh, as the plan carries it (parallel/layout.py)."""
        return self.layout.mesh

    def summary(self) -> dict[str, Any]:
        """What the strategy adds to summary.json (collective: every worker's bytes of weights are gathered)."""
        import torch.distributed as dist

        from ...runtime.dist import local

        held = sum(local(p).numel() * local(p).element_size() for p in self.module.parameters())
        every: list[Any] = [held]
        if self.ctx.distributed:
            every = [None] * self.ctx.world_size
            dist.all_gather_object(every, held)
        return {"strategy": self.name, "world_size": self.ctx.world_size, "pipeline": None,
                "mesh": self.dims().sizes, "weight_bytes_per_worker": every}
