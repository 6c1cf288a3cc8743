"""What a worker's run changes as it goes (RunState), its loss and compiler settings, and the summary its
rank 0 writes (summary.json) from that state and the run's record: apart from the loop (trainer.py)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ..core.run_paths import RunPaths
from ..runtime import clock

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..runtime.env import Environment


def quiet_compiler(device_type: str) -> None:
    """torch.compile in a worker: on CPUs, code generation in this process (inductor's pool of compile processes
    would put more processes than cores beside the workers, which compute on every core, and leaves a semaphore
    behind at a worker's exit); on GPUs, as many compile processes as torch chooses (Triton's kernels compile in
    parallel on the host's cores, which the GPUs' workers leave idle). Without the warning that a CPU machine has
    no CUDA runtime (which no CPU run needs), and without leaving a semaphore behind."""
    import logging
    import threading

    import torch._inductor.config as inductor
    from tqdm import tqdm

    if device_type == "cpu":
        inductor.compile_threads = 1
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # a graph over DTensors (tensor parallelism) is not kept in AOTAutograd's cache, which warns so on every rank
    logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.ERROR)
    # torch 2.14's own partitioner calls its deprecated is_opaque_value, which warns on every rank when a graph
    # over DTensors compiles with a cold cache (the CI's first --strategy tp run): torch's notice to itself
    logging.getLogger("torch._library.opaque_object").addFilter(
        lambda record: "is_opaque_value is deprecated" not in record.getMessage())
    # torch.fx's interpreter opens a tqdm bar while compiling, and tqdm's default lock is a multiprocessing
    # semaphore that a worker leaving through os._exit never releases ("resource_tracker: ... 1 leaked
    # semaphore" at the end of a 2-worker --compile run): a thread lock is enough (as tracking/log.py's)
    tqdm.set_lock(threading.RLock())


WARM_STEPS = 2  # --compile: the first steps, which compile the forward and backward graphs


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (torch.compile's own account: tracing, code generation
    and the C++ build, of forward and backward graphs); 0 where torch keeps no such account."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 (a private account, which another torch may lack or name otherwise)
        return 0.0


@dataclass
class RunState:
    """What a run changes as it goes. A checkpoint restores the model, optimizer, scheduler, scaler, EMA and step."""

    model: nn.Module  # this worker's trained module, unwrapped (the strategy's `module`)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    ema: AveragedModel | None
    step: int = 0
    first_step: int = 0  # where this process started (a resumed run's checkpoint step)
    saved_step: int = -1  # the step of the last checkpoint written
    steps_run: int = 0
    train_time: float = 0.0
    eval_time: float = 0.0
    checkpoint_wait: float = 0.0  # seconds the loop waited on checkpoints (this start's)
    # --compile: this process's compiling account when the run began and the time (and steps) of the first steps,
    # which compiled, left out of the training rates
    compile_start: float = 0.0
    compile_time: float | None = None
    warm_time: float = 0.0
    warm_steps: int = 0
    val: tuple[float, float, dict[str, float]] = (math.nan, math.nan, {})  # accuracy, loss, metrics
    stop: str | None = None  # why the run ended early: "time" (--max-time), "signal", "early" (--early-stopping)
    # or "pruned" (a search's pruner)
    validated: int = 0  # epochs validated (a checkpoint at an epoch's last step comes before its validation)
    best_val_loss: float = math.inf  # --early-stopping: the lowest validation loss so far
    since_best: int = 0  # and the epochs validated since it
    val_ema: tuple[float, float, dict[str, float]] | None = None  # the weight average's, at the end (--ema)

    def warmed(self, epoch_time: float, compiled: float) -> None:
        """--compile, at the end of the WARM_STEPS-th step of this start: `epoch_time` into the epoch, with
        `compiled` seconds in this process's compiling account."""
        self.warm_time, self.warm_steps = self.train_time + epoch_time, self.steps_run
        self.compile_time = compiled - self.compile_start

    @property
    def rated(self) -> tuple[int, float]:
        """The steps and training time a training rate is of: with --compile, those after the first WARM_STEPS
        (which compiled the forward and backward graphs; in a pipeline, a stage's compiling keeps the others
        waiting) where there are any after them."""
        if self.warm_steps and self.steps_run > self.warm_steps:
            return self.steps_run - self.warm_steps, self.train_time - self.warm_time
        return self.steps_run, self.train_time

    def extras(self, epoch: int, config: dict[str, Any], data: dict[str, Any],
               parts: dict[str, Any] | None) -> dict[str, Any]:
        """What a checkpoint holds besides the model and the optimizer state (what `restore` reads): `config`
        the run's, `data` the data's shape (to rebuild the model without the data), `parts` which network,
        optimizer and loss of the user's ran."""
        extras = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "step": self.step,
                  "epoch": epoch, "config": config, "data": data, "validated": self.validated,
                  "early_stopping": (self.best_val_loss, self.since_best)}
        if parts:
            extras["parts"] = parts
        if self.ema is not None:  # its weights are the strategy's to save
            extras["ema_n_averaged"] = int(self.ema.n_averaged)
        return extras

    def restore(self, saved: dict[str, Any], per_epoch: int, patience: int | None) -> None:
        """A checkpoint's schedule, scaler, EMA count, step and early-stopping record (the strategy restores
        the optimizer state and the EMA's weights)."""
        self.scheduler.load_state_dict(saved.get("scheduler", {"last_epoch": saved["step"]}))
        self.scaler.load_state_dict(saved.get("scaler", {}))
        if self.ema is not None and saved.get("ema_n_averaged") is not None:
            self.ema.n_averaged.fill_(saved["ema_n_averaged"])
        self.step = self.first_step = int(saved["step"])
        # a checkpoint of an earlier version: its epochs count as validated
        self.validated = int(saved.get("validated", self.step // per_epoch))
        self.best_val_loss, self.since_best = saved.get("early_stopping", (math.inf, 0))
        if patience is not None and self.since_best >= patience:
            self.stop = "early"  # it had stopped early: resumed (or restarted), it trains no further

    def watch_val_loss(self, patience: int | None) -> None:
        """--early-stopping after a validation: every worker holds the same validation loss (evaluation reduces
        it), so every worker decides alike, with no message passed."""
        if patience is None:
            return
        if self.val[1] < self.best_val_loss:
            self.best_val_loss, self.since_best = self.val[1], 0
        else:  # a NaN validation loss too
            self.since_best += 1
        if self.since_best >= patience and self.stop is None:
            self.stop = "early"


@dataclass(frozen=True)
class RunRecord:
    """What a run's summary says besides its state: what ran, where, who started it, how it started and ended."""

    cfg: TrainConfig
    model: str  # the registry's name, or the user's network's
    per_epoch: int  # updates per epoch (the plan's length)
    devices: list[str]  # each worker's device
    run_dir: Path
    env: Environment
    restarts: int
    parts: dict[str, Any] | None  # the user's own parts that ran (parts.yaml)
    classes: list[str] | None
    marks: dict[str, float]  # start-up marks (runtime/clock.py)
    finish_s: dict[str, float | None]  # the finish's phases
    step_phases: dict[str, Any]  # the step's phases (--time-phases)
    language: dict[str, Any] | None = None  # a sequence model's (language_of): tokens, FLOPs, the device's peak


def _local_bytes(tensor: torch.Tensor) -> int:
    """The bytes of `tensor` this worker holds: its own shard of a sharded (DTensor) one."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def memory_held(device: torch.device) -> int:
    """The bytes this worker holds now: the GPU's allocated bytes, or the process's resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    """A figure of /proc/self/status (Linux), in KiB; 0 elsewhere."""
    import resource

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        # the peak is also in getrusage (Linux counts it in KiB), not the resident set now
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if field == "VmHWM" else 0


def memory_figures(module: nn.Module, optimizer: torch.optim.Optimizer, ctx: Any, at_start: int) -> dict[str, Any]:
    """For each worker: the bytes of the model state it holds (its parameters, their gradients, which exist
    during every step, and its optimizer state: its shards under fsdp), its peak memory (the GPU's allocated bytes
    since the worker joined, as worker.work resets torch's counter, or the process's resident set on the CPU, the
    process's whole life; the set-up's moments included, such as a model built whole before it is sharded), and
    that peak less `at_start`, what it held as it began building the model, the data in place (on the CPU, the
    ~0.5 GB of torch's libraries are in both: the difference is what the model, its optimizer state and the
    steps' activations took). A collective: every worker calls it."""
    params = sum(_local_bytes(p) for p in module.parameters())
    grads = sum(_local_bytes(p) for p in module.parameters() if p.requires_grad)
    state = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    on_gpu = ctx.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(ctx.device) if on_gpu else _status_kib("VmHWM") * 1024
    rows = torch.zeros(ctx.world_size, 5, dtype=torch.float64, device=ctx.device)
    rows[ctx.rank] = torch.tensor([params, grads, state, peak, peak - at_start], dtype=torch.float64)
    ctx.all_reduce_sum(rows)
    held = [{"parameters": int(p), "gradients": int(g), "optimizer": int(o), "total": int(p + g + o)}
            for p, g, o, _, _ in rows.tolist()]
    return {"model_state_bytes": held, "peak_memory_bytes": [int(r[3]) for r in rows.tolist()],
            "peak_memory_added_bytes": [int(r[4]) for r in rows.tolist()],
            "peak_memory_of": "gpu allocated" if on_gpu else "process rss"}


def summary_of(state: RunState, record: RunRecord, test: tuple[float, float, dict],
               test_ema: tuple[float, float, dict] | None, added: dict[str, Any]) -> dict[str, Any]:
    """summary.json's figures: the run's state and record, its test (and the EMA's), the strategy's own."""
    cfg, per_update, env = record.cfg, record.cfg.batch_size * record.cfg.accumulate, record.env
    reported = test_ema if cfg.eval_ema else test

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "model": record.model,
        "dataset": cfg.dataset, "strategy": added["strategy"], "world_size": added["world_size"],
        "mesh": added["mesh"], "weight_bytes_per_worker": added["weight_bytes_per_worker"],
        "global_batch_size": per_update, "steps": state.step,
        "epochs": math.ceil(state.step / record.per_epoch),
        "train_time_s": state.train_time, "eval_time_s": state.eval_time, "step_phases_s": record.step_phases,
        "checkpoint_wait_s": state.checkpoint_wait,
        "examples_per_sec": state.rated[0] * per_update / state.rated[1] if state.steps_run and state.rated[1]
        else None,
        "compile_s": state.compile_time, "compile_steps_s": state.warm_time if state.warm_steps else None,
        "test_accuracy": finite(reported[0]), "test_loss": reported[1],  # None: no classes, or no test set
        "val_accuracy": finite(state.val[0]), "val_loss": finite(state.val[1]),
        "test_accuracy_raw": finite(test[0]), "test_accuracy_ema": finite(test_ema[0]) if test_ema else None,
        "evaluated_with": "ema" if cfg.eval_ema else "weights", "stopped_by_time": state.stop == "time",
        "stopped_early": state.stop == "early", "pruned": state.stop == "pruned",
        "epochs_validated": state.validated,
        "final_lr": state.optimizer.param_groups[0]["lr"], "precision": cfg.precision, "seed": cfg.seed,
        "torch_version": torch.__version__, "devices": record.devices,
        "run_dir": str(record.run_dir), "pipeline": added["pipeline"], "restarts": record.restarts,
        "resumed_from_step": state.first_step or None, "parts": record.parts, "classes": record.classes,
        "startup_s": clock.startup(record.marks), "first_step_at_s": clock.first_step_at(record.marks),
        "finish_s": record.finish_s, "ended_at": time.time(),
        "launcher": env.launcher_name,  # who started the workers; Slurm's job and requeues
        "slurm_job": env.slurm.name if env.slurm else None, "requeues": env.slurm.restart_count if env.slurm else None,
        "metrics": list(reported[2]),  # their names (--metric, fit's metrics=): val_NAME and test_NAME
        **{f"val_{k}": finite(v) for k, v in state.val[2].items()},
        **{f"test_{k}": finite(v) for k, v in reported[2].items()},
        **language_figures(state, record, reported, test_ema), **ema_figures(state.val_ema, test_ema),
    }


def pruned(ctx: Any, report: Any, epoch: int, val: tuple[float, float, dict], per_target: bool) -> bool:
    """A search trial after a validation: rank 0 reports the figures (its objective among them) and hears
    whether the pruner stops the trial; every worker learns the answer (one tiny all-reduce) and stops alike."""
    from ..optimization.losses import perplexity

    verdict, (acc, loss, metrics) = torch.zeros(1, device=ctx.device), val
    lm = {"val_perplexity": perplexity(loss)} if per_target else {}
    if ctx.is_main and report(epoch + 1, {"val_accuracy": acc, "val_loss": loss, **lm,
                                          **{f"val_{k}": v for k, v in metrics.items()}}):
        verdict.fill_(1)
    if ctx.distributed:
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX)
    return bool(verdict.item())


def ema_figures(val: tuple[float, float, dict] | None, test: tuple[float, float, dict] | None) -> dict[str, Any]:
    """--ema: the weight average's loss, accuracy (None without classes) and metrics on the validation and test
    sets, beside the weights' own, whatever the task."""
    out: dict[str, Any] = {}
    for split, figures in (("val", val), ("test", test)):
        if figures is None:
            continue
        accuracy, loss, metrics = figures
        out.update({f"{split}_loss_ema": loss if math.isfinite(loss) else None,
                    f"{split}_accuracy_ema": accuracy if math.isfinite(accuracy) else None,
                    **{f"{split}_{k}_ema": v for k, v in metrics.items()}})
    return out


def language_of(model: nn.Module, data: Any, per_target: bool) -> dict[str, Any] | None:
    """What a summary says of a model over token ids: the tokens an example, the FLOPs a token (counted on the
    whole model), whether the loss is the built-in cross-entropy over the tokens (perplexity), and the text's
    UTF-8 bytes a token (bits per byte), how packed examples fill their windows (--pack); None for other data."""
    from ..models.flops import flops_per_token

    tokens = data.tokens_per_example
    if tokens is None:
        return None
    flops, counted = flops_per_token(model, tokens)
    return {"tokens_per_example": tokens, "flops_per_token": flops, "flops_counted": counted,
            "per_target": per_target, "bytes_per_token": (data.text or {}).get("bytes_per_token"),
            "packed": (data.text or {}).get("packed")}


def _device_peak(devices: list[str], precision: str) -> tuple[float | None, str]:
    """One worker's device's peak FLOP/s (runtime/peaks.py) and where it comes from."""
    from ..runtime import peaks

    device = devices[0] if devices else "cpu"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device.split(" ")[0]))
        peak = peaks.gpu_peak(name, precision)
        return peak, f"{name}: " + ("the maker's dense figure" if peak else "not in paratrain's table of GPUs")
    peak = peaks.cpu_peak(torch.get_num_threads())  # this worker's threads (the summary is written in a worker)
    return peak, ("this CPU's float32 matrix multiply, measured by paratrain doctor" if peak else
                  "unknown for this CPU: run paratrain doctor once to measure it")


def language_figures(state: RunState, record: RunRecord, reported: tuple[float, float, dict],
                     test_ema: tuple[float, float, dict] | None) -> dict[str, Any]:
    """A language model's figures: tokens/s, perplexity and bits per byte (the built-in loss over the tokens),
    FLOPs a token, the FLOP/s achieved and the model FLOPs utilisation (where the device's peak is known)."""
    lm = record.language
    if lm is None:
        return {}
    per_update = record.cfg.batch_size * record.cfg.accumulate
    tokens_per_sec = state.rated[0] * per_update * lm["tokens_per_example"] / state.rated[1] \
        if state.steps_run and state.rated[1] else None
    achieved = lm["flops_per_token"] * tokens_per_sec if tokens_per_sec else None
    peak, peak_of = _device_peak(record.devices, record.cfg.precision)
    total_peak = peak * len(record.devices) if peak else None
    out: dict[str, Any] = {
        "tokens_per_sec": tokens_per_sec, "flops_per_token": lm["flops_per_token"],
        "flops_counted": lm["flops_counted"],
        "achieved_flops_per_sec": achieved, "peak_flops_per_sec": total_peak, "peak_of": peak_of,
        "mfu": achieved / total_peak if achieved and total_peak else None}
    if lm.get("packed"):  # the training examples, the windows they fill, and the share of positions they hold
        out |= {f"packed_{k}": lm["packed"][k] for k in ("examples", "windows", "fill")}
    if lm["per_target"]:
        from ..optimization.losses import perplexity

        losses = {"val": state.val[1], "test": reported[1], **({"test_ema": test_ema[1]} if test_ema else {})}
        for split, loss in losses.items():
            ok = math.isfinite(loss)
            name = split.replace("_ema", "")
            suffix = "_ema" if split.endswith("_ema") else ""
            out[f"{name}_perplexity{suffix}"] = perplexity(loss) if ok else None
            per_byte = (lm["bytes_per_token"] or {}).get(name)  # the split's own bytes a token
            if per_byte:
                out[f"{name}_bits_per_byte{suffix}"] = loss / math.log(2) / per_byte if ok else None
    return out


# What a start that trains no step (a finished run evaluated again) takes from the run's summary.json: the
# figures of the training, which this start did not measure.
TRAINED_FIGURES = ("strategy", "world_size", "train_time_s", "step_phases_s", "examples_per_sec", "val_accuracy",
                   "val_loss", "stopped_by_time", "stopped_early", "pruned", "epochs_validated", "devices", "restarts",
                   "resumed_from_step", "startup_s", "first_step_at_s", "sync_wait_s", "straggler", "tokens_per_sec",
                   "achieved_flops_per_sec", "mfu")


def trained_figures(run_dir: Path, step: int) -> dict[str, Any]:
    """The figures of the start that trained up to `step`, from summary.json; none where that file is
    missing, unreadable or an earlier start's (stopped or killed after its last step, before its summary)."""
    try:
        earlier = json.loads(RunPaths(run_dir).summary.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(earlier, dict) or earlier.get("steps") != step:
        return {}
    return {k: earlier[k] for k in TRAINED_FIGURES if k in earlier}
