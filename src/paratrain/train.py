"""The one training loop: fit -> evaluate -> summary. Every worker runs it; rank 0 writes and prints."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

from . import checkpoint, strategies
from .config import PIPELINED, TrainConfig
from .data import Splits
from .data.sharding import epoch_permutation, eval_range, global_batch, steps_per_epoch, worker_part
from .data.transforms import Augment, BatchPipeline
from .dist import DistContext
from .errors import UserError
from .interrupt import Stopped, StopRequest, signal_name
from .models import build_model, input_size
from .optim import make_optimizer, make_scheduler
from .parts import Parts
from .phases import PhaseTimer
from .runlog import RunLog, write_summary

if TYPE_CHECKING:
    from .strategies.pipeline import Pipeline

AUTOCAST = {"32": None, "bf16": torch.bfloat16, "16-mixed": torch.float16}


def make_model(cfg: TrainConfig, data: Splits, parts: Parts | None = None) -> nn.Module:
    """The user's network (from their factory) or the registry's, on the CPU."""
    if parts is not None and parts.model is not None:
        return parts.model()
    return build_model(cfg.model, data.channels, input_size(cfg.model, data.image_size), data.num_classes,
                       width=cfg.width, depth=cfg.depth, activation=cfg.activation, dropout=cfg.dropout,
                       filters=cfg.filters, kernel=cfg.kernel)


def make_batch_transforms(cfg: TrainConfig, data: Splits, device: torch.device) -> BatchPipeline:
    """Normalisation and the training augmentation, applied to whole batches on the device."""
    augment = Augment(cfg.random_crop, cfg.crop_padding, cfg.hflip, cfg.brightness, cfg.contrast)
    return BatchPipeline(data.mean, data.std, input_size(cfg.model, data.image_size), device, augment)


def ema_decay(decay: float, num_updates: int) -> float:
    """TensorFlow's ExponentialMovingAverage(decay, num_updates), as the CIFAR-10 tutorial uses it: the
    decay ramps up as min(decay, (1 + n) / (10 + n)), so a young average is not stuck at the start."""
    return min(decay, (1 + num_updates) / (10 + num_updates))


def make_ema(model: nn.Module, decay: float) -> AveragedModel:
    """ema <- d * ema + (1 - d) * weights after every update, d = ema_decay(decay, updates so far);
    the first update copies the weights."""

    @torch.no_grad()
    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        d = ema_decay(decay, int(num_averaged))
        torch._foreach_lerp_(averaged, current, 1 - d)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one worker's randomness (dropout, augmentation) at one step: a pure function, so a
    resumed run draws exactly what an uninterrupted one would, and workers draw differently."""
    return ((seed * 1_000_003 + step) * 4099 + rank) % (2**63)


@torch.no_grad()
def evaluate(model: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prep: BatchPipeline, ctx: DistContext,
             batch_size: int, loss: Any = None) -> tuple[float, float]:
    """Accuracy and mean loss over the whole set: each worker takes a contiguous, unpadded share and
    the sums are all-reduced, so the figures are exactly those of the full set."""
    x_all, y_all = pair
    share = eval_range(len(y_all), ctx.rank, ctx.world_size)
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    was_training = model.training
    model.eval()
    for start in range(share.start, share.stop, batch_size):
        stop = min(start + batch_size, share.stop)
        logits = model(prep.eval(x_all[start:stop]))
        y = y_all[start:stop]
        if loss is None:
            sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
        else:  # a user's loss is the batch mean
            sums[0] += loss(logits.float(), y).double() * (stop - start)
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += stop - start
    model.train(was_training)
    loss_sum, correct, count = ctx.all_reduce_sum(sums).tolist()
    if count == 0:
        return math.nan, math.nan
    return correct / count, loss_sum / count


def _state(cfg: TrainConfig, weights: nn.Module, optimizer_state: dict, scheduler: Any, scaler: Any,
           ema: AveragedModel | None, step: int, epoch: int, data: Splits) -> dict[str, Any]:
    def cpu(module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    state = {"model": cpu(weights), "optimizer": optimizer_state,
             "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step, "epoch": epoch,
             "config": cfg.to_dict(), "data": data.shape_info()}  # to rebuild the model without the data
    if ema is not None:
        state["ema_model"] = cpu(ema.module)
        state["ema_n_averaged"] = int(ema.n_averaged)
    return state


def make_stage(cfg: TrainConfig, ctx: DistContext, data: Splits, model: nn.Module, loss: Any) -> Pipeline:
    """This worker's stage of the pipeline (pipeline and hybrid strategies)."""
    from .strategies.pipeline import Layout, Pipeline, layers_of  # imported only where a pipeline runs

    layout = Layout(cfg.stages, ctx.world_size // cfg.stages, ctx.rank)
    side = input_size(cfg.model, data.image_size)
    micro = cfg.batch_size // layout.replicas // cfg.microbatches
    cuts = [int(c) for c in cfg.split.split(",")]  # resolved once before launch (api.pipeline_split)
    return Pipeline(layers_of(model, cfg.model), cuts, layout, ctx.device, cfg.microbatches, cfg.schedule,
                    torch.zeros(micro, data.channels, side, side), loss)


def fit(ctx: DistContext, cfg: TrainConfig, data: Splits, resume: dict[str, Any] | None = None,
        devices: list[str] | None = None, stop: StopRequest | None = None, restarts: int = 0,
        parts: Parts | None = None) -> dict[str, Any] | None:
    """Train, evaluate, write the run directory. Returns the summary on rank 0, None elsewhere.
    `stop` records SIGINT/SIGTERM: the workers then stop together, save, and raise Stopped.
    `restarts`: how many times the launcher restarted this run after a worker died (for the summary).
    `parts`: the user's own model factory, optimizer factory and loss, in place of the configuration's."""
    run_dir = Path(cfg.out)
    B, W, acc = cfg.batch_size, ctx.world_size, cfg.accumulate
    n_train = len(data.train[1])
    per_epoch = steps_per_epoch(n_train, B * acc)  # optimizer updates per epoch
    if per_epoch == 0:
        raise UserError(f"--batch-size {B} x --accumulate {acc} is more than the {n_train} training examples; "
                        "lower them")
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    epochs = math.ceil(total_steps / per_epoch)

    # The optimizer state is updated in place: this worker must own it, not share the caller's buffers.
    resume = checkpoint.owned(resume) if resume is not None else None
    parts = parts or Parts()
    torch.manual_seed(cfg.seed)  # the same initial weights on every worker (DDP broadcasts them anyway)
    model = make_model(cfg, data, parts)
    loss_fn = parts.loss  # None: cross-entropy
    if resume is not None:
        checkpoint.load_weights(model, resume, cfg.resume)
    # A pipeline worker trains only its stage's layers; dp_rank/dp_size: which share of each batch it takes.
    stage = make_stage(cfg, ctx, data, model, loss_fn or F.cross_entropy) if cfg.strategy in PIPELINED else None
    model = stage.module if stage is not None else model.to(ctx.device)
    dp_rank, dp_size = (stage.layout.replica, stage.layout.replicas) if stage else (ctx.rank, W)
    optimizer = (parts.optimizer or partial(make_optimizer, cfg))(model.parameters())
    scheduler = make_scheduler(cfg, optimizer, total_steps, per_epoch)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "16-mixed")
    ema = make_ema(model, cfg.ema) if cfg.ema else None
    step = 0
    if resume is not None:
        if stage is not None:
            stage.load_optimizer(optimizer, resume["optimizer"])
        else:
            optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume.get("scheduler", {"last_epoch": resume["step"]}))
        scaler.load_state_dict(resume.get("scaler", {}))
        if ema is not None and "ema_model" in resume:
            ema.module.load_state_dict(resume["ema_model"])
            ema.n_averaged.fill_(resume["ema_n_averaged"])
        step = int(resume["step"])
    first_step = step
    model = strategies.wrap(model, ctx, cfg)
    raw = strategies.unwrap(model)
    data = data.to(ctx.device)
    pipe = make_batch_transforms(cfg, data, ctx.device)
    train_x, train_y = data.train
    log = RunLog(run_dir, ctx.is_main, cfg, total_steps, step)
    ckpt_dir = run_dir / "checkpoints"
    autocast_dtype = AUTOCAST[cfg.precision]

    def autocast() -> contextlib.AbstractContextManager:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(ctx.device.type, dtype=autocast_dtype)

    def whole_model() -> nn.Module:
        """The model with its current weights: gathered from the stages in a pipeline (collective)."""
        return stage.gather_model() if stage is not None else raw

    saved_step = -1

    def checkpoint_now(epoch: int) -> None:
        nonlocal saved_step
        saved_step = step
        if stage is not None:  # collectives: every worker takes part, rank 0 writes
            weights, optimizer_state = whole_model(), stage.gather_optimizer(optimizer)
        elif ctx.is_main:
            weights, optimizer_state = raw, optimizer.state_dict()
        if ctx.is_main:
            state = _state(cfg, weights, optimizer_state, scheduler, scaler, ema, step, epoch, data)
            checkpoint.save_step(state, ckpt_dir, step, cfg.keep_checkpoints)

    timer = PhaseTimer(ctx, cfg.time_phases)
    eval_time = 0.0
    generator = ctx.generator()  # torch.manual_seed would also seed every GPU: ~0.2 ms a step
    train_time = 0.0
    steps_run = 0
    stopped_by_time = stopped_by_signal = False
    val = (math.nan, math.nan)
    window = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count since log
    # mean loss (summed over the workers that compute one), any worker's stop
    to_means = torch.tensor([dp_size, 1.0, 1.0], dtype=torch.float64, device=ctx.device)
    t_start = t_window = time.perf_counter()
    model.train()
    for epoch in range(step // per_epoch, epochs):
        perm = epoch_permutation(n_train, cfg.seed, epoch).to(ctx.device)
        ctx.synchronize()
        t_epoch = time.perf_counter()
        for i in range(step - epoch * per_epoch, min(per_epoch, total_steps - epoch * per_epoch)):
            generator.manual_seed(step_seed(cfg.seed, step, ctx.rank))
            step_loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
            for k in range(acc):  # micro-batches; DDP all-reduces only on the last backward
                with timer.phase("data"):
                    idx = worker_part(global_batch(perm, i * acc + k, B), dp_rank, dp_size)
                    x, y = pipe.train(train_x[idx], generator), train_y[idx]
                if stage is not None:  # forward and backward through the stages; the last has the loss
                    loss, logits = stage.step(x, y)
                    if loss is None:
                        continue
                else:
                    inner = k < acc - 1 or timer.active  # timed runs all-reduce explicitly, below
                    no_sync = model.no_sync() if ctx.distributed and inner else contextlib.nullcontext()
                    with no_sync, timer.phase("compute"):
                        with autocast():
                            logits = model(x)
                        loss = (loss_fn or F.cross_entropy)(logits.float(), y)
                        scaler.scale(loss / acc).backward()
                step_loss += loss.detach().double()
                # Accumulate on the device; read back only at log steps (an .item() per batch stalls a GPU).
                window[0] += loss.detach().double() * len(y)
                window[1] += (logits.detach().argmax(1) == y).sum()
                window[2] += len(y)
            # One tiny all-reduce per update: every worker learns, before updating, whether any loss is
            # non-finite, whether rank 0's clock ran out, and whether any worker was asked to stop
            # (SIGINT/SIGTERM), so they all stop at the same step.
            time_up = ctx.is_main and cfg.max_time is not None and time.perf_counter() - t_start > cfg.max_time
            asked = stop is not None and stop.signum != 0
            flags = torch.stack([step_loss / acc, torch.tensor(float(time_up), device=ctx.device, dtype=torch.float64),
                                 torch.tensor(float(asked), device=ctx.device, dtype=torch.float64)])
            mean_loss, time_flag, signal_flag = (ctx.all_reduce_sum(flags) / to_means).tolist()
            if not math.isfinite(mean_loss):
                log.close()
                raise UserError(f"the loss became {mean_loss} at step {step + 1}; stopped before updating. "
                                f"Lower --lr; the last good checkpoint is kept in {ckpt_dir}", code=3)
            timer.allreduce_gradients(raw)
            if stage is not None:
                stage.average_gradients()
            with timer.phase("optimizer"):
                if cfg.clip_grad_norm:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                if ema is not None:
                    ema.update_parameters(raw)
            timer.steps += 1
            step += 1
            steps_run += 1
            if cfg.histogram_every and step % cfg.histogram_every == 0:
                log.histograms(step, raw)
            optimizer.zero_grad(set_to_none=True)
            if step % cfg.log_every == 0 or step == total_steps:
                loss_sum, correct, count = ctx.all_reduce_sum(window).tolist()
                now = time.perf_counter()
                log.step(step=step, epoch=epoch + 1, loss=loss_sum / count, train_accuracy=correct / count,
                         examples_per_sec=count / (now - t_window), lr=optimizer.param_groups[0]["lr"],
                         time_s=now - t_window, sec_per_batch=(now - t_window) * B * acc / count)
                window.zero_()
                t_window = now
            log.advance()
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                checkpoint_now(epoch)
            if signal_flag:
                stopped_by_signal = True
                break
            if time_flag:
                stopped_by_time = True
                break
        ctx.synchronize()
        epoch_time = time.perf_counter() - t_epoch
        train_time += epoch_time
        if stopped_by_signal:  # save what was done and leave quickly: no evaluation
            if saved_step != step:
                checkpoint_now(epoch)
            log.close()
            signum = stop.signum if stop is not None and stop.signum else signal.SIGTERM
            raise Stopped(f"stopped by {signal_name(signum)} at step {step}; the checkpoint is in {ckpt_dir}; "
                          f"continue with --resume {run_dir}", signum)
        t_eval = time.perf_counter()
        if len(data.val[1]):
            val = evaluate(ema.module if cfg.eval_ema else whole_model(), data.val, pipe, ctx, cfg.eval_batch_size,
                           loss_fn)
        eval_time += time.perf_counter() - t_eval
        log.epoch(step=step, epoch=epoch + 1, epochs=epochs, val_accuracy=val[0], val_loss=val[1],
                  epoch_time_s=epoch_time)
        t_window += time.perf_counter() - t_eval  # evaluation is not training time: the window skips it
        if stopped_by_time or stopped_by_signal:
            break

    t_eval = time.perf_counter()
    test = evaluate(whole_model(), data.test, pipe, ctx, cfg.eval_batch_size, loss_fn)
    test_ema = evaluate(ema.module, data.test, pipe, ctx, cfg.eval_batch_size, loss_fn) if ema is not None else None
    eval_time += time.perf_counter() - t_eval
    checkpoint_now(epochs)
    log.close()
    pipeline_info = {"stages": cfg.stages, "microbatches": cfg.microbatches, "schedule": cfg.schedule,
                     "cuts": cfg.split, "bubble": stage.bubble()} if stage is not None else None
    if not ctx.is_main:
        return None
    reported = test_ema if cfg.eval_ema else test

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    summary = {
        "model": parts.model_name() if parts.model is not None else cfg.model,
        "dataset": cfg.dataset, "strategy": strategies.name(ctx, cfg),
        "world_size": int(cfg.devices) if cfg.strategy == "tower" else W, "global_batch_size": B * acc,
        "steps": step, "epochs": math.ceil(step / per_epoch),
        "train_time_s": train_time, "eval_time_s": eval_time, "step_phases_s": timer.per_step(),
        "examples_per_sec": steps_run * B * acc / train_time if steps_run and train_time else None,
        "test_accuracy": reported[0], "test_loss": reported[1],
        "val_accuracy": finite(val[0]), "val_loss": finite(val[1]),
        "test_accuracy_raw": test[0], "test_accuracy_ema": test_ema[0] if test_ema else None,
        "evaluated_with": "ema" if cfg.eval_ema else "weights", "stopped_by_time": stopped_by_time,
        "final_lr": optimizer.param_groups[0]["lr"], "precision": cfg.precision,
        "seed": cfg.seed, "torch_version": torch.__version__, "devices": devices or [str(ctx.device)] * W,
        "run_dir": str(run_dir), "pipeline": pipeline_info, "restarts": restarts,
        "resumed_from_step": first_step or None,
    }
    write_summary(run_dir, summary)
    return summary
