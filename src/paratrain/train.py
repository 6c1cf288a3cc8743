"""The one training loop: fit -> evaluate -> summary. Every worker runs it; rank 0 writes and prints."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, strategies
from .config import TrainConfig
from .data import Splits
from .data.sharding import epoch_permutation, eval_range, global_batch, steps_per_epoch, worker_part
from .data.transforms import Normalize
from .dist import DistContext
from .errors import UserError
from .models import build_model, input_size
from .runlog import RunLog, write_summary


def make_model(cfg: TrainConfig, data: Splits) -> nn.Module:
    return build_model(cfg.model, data.channels, input_size(cfg.model, data.image_size), data.num_classes,
                       width=cfg.width, depth=cfg.depth, activation=cfg.activation, dropout=cfg.dropout)


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:  # noqa: ANN001
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one worker's randomness (dropout) at one step: a pure function, so a resumed run
    draws exactly what an uninterrupted one would, and workers draw different masks."""
    return ((seed * 1_000_003 + step) * 4099 + rank) % (2**63)


@torch.no_grad()
def evaluate(model: nn.Module, pair: tuple[torch.Tensor, torch.Tensor], prep: Normalize, ctx: DistContext,
             batch_size: int) -> tuple[float, float]:
    """Accuracy and mean loss over the whole set: each worker takes a contiguous, unpadded share and
    the sums are all-reduced, so the figures are exactly those of the full set."""
    x_all, y_all = pair
    share = eval_range(len(y_all), ctx.rank, ctx.world_size)
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    was_training = model.training
    model.eval()
    for start in range(share.start, share.stop, batch_size):
        stop = min(start + batch_size, share.stop)
        logits = model(prep(x_all[start:stop]))
        y = y_all[start:stop]
        sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += stop - start
    model.train(was_training)
    loss_sum, correct, count = ctx.all_reduce_sum(sums).tolist()
    if count == 0:
        return math.nan, math.nan
    return correct / count, loss_sum / count


def _state(cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
           epoch: int) -> dict[str, Any]:
    cpu = {k: v.detach().cpu() for k, v in strategies.unwrap(model).state_dict().items()}
    return {"model": cpu, "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
            "config": cfg.to_dict()}


def fit(ctx: DistContext, cfg: TrainConfig, data: Splits, resume: dict[str, Any] | None = None,
        devices: list[str] | None = None) -> dict[str, Any] | None:
    """Train, evaluate, write the run directory. Returns the summary on rank 0, None elsewhere."""
    run_dir = Path(cfg.out)
    B, W = cfg.batch_size, ctx.world_size
    n_train = len(data.train[1])
    per_epoch = steps_per_epoch(n_train, B)
    if per_epoch == 0:
        raise UserError(f"--batch-size {B} is larger than the {n_train} training examples; lower it")
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    epochs = math.ceil(total_steps / per_epoch)

    torch.manual_seed(cfg.seed)  # the same initial weights on every worker (DDP broadcasts them anyway)
    model = make_model(cfg, data).to(ctx.device)
    optimizer = make_optimizer(cfg, model.parameters())
    step = 0
    if resume is not None:
        checkpoint.load_weights(model, resume, cfg.resume)
        optimizer.load_state_dict(resume["optimizer"])
        step = int(resume["step"])
    model = strategies.wrap(model, ctx)
    data = data.to(ctx.device)
    prep = Normalize(data.mean, data.std, input_size(cfg.model, data.image_size), ctx.device)
    train_x, train_y = data.train
    log = RunLog(run_dir, ctx.is_main, cfg.quiet, total_steps, step)
    ckpt_path = run_dir / "checkpoints" / "last.pt"

    train_time = 0.0
    steps_run = 0
    val_acc = val_loss = math.nan
    window = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count since log
    t_window = time.perf_counter()
    generator = ctx.generator()  # torch.manual_seed would also seed every GPU: ~0.2 ms a step
    model.train()
    for epoch in range(step // per_epoch, epochs):
        perm = epoch_permutation(n_train, cfg.seed, epoch).to(ctx.device)
        ctx.synchronize()
        t_epoch = time.perf_counter()
        for i in range(step - epoch * per_epoch, min(per_epoch, total_steps - epoch * per_epoch)):
            idx = worker_part(global_batch(perm, i, B), ctx.rank, W)
            x, y = prep(train_x[idx]), train_y[idx]
            generator.manual_seed(step_seed(cfg.seed, step, ctx.rank))
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            steps_run += 1
            # Accumulate on the device; read back only at log steps (a .item() per step would stall a GPU).
            window[0] += loss.detach().double() * len(y)
            window[1] += (logits.detach().argmax(1) == y).sum()
            window[2] += len(y)
            due_checkpoint = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
            # A checkpoint step is also a check step, so a non-finite loss is caught before it is saved.
            if step % cfg.log_every == 0 or step == total_steps or due_checkpoint:
                loss_sum, correct, count = ctx.all_reduce_sum(window).tolist()
                now = time.perf_counter()
                mean_loss = loss_sum / count
                if not math.isfinite(mean_loss):
                    raise UserError(f"the loss became {mean_loss} at step {step}; lower --lr", code=3)
                log.record(step=step, epoch=epoch + 1, loss=mean_loss, train_accuracy=correct / count,
                           examples_per_sec=count / (now - t_window), lr=optimizer.param_groups[0]["lr"],
                           time_s=now - t_window)
                log.advance(0, loss=mean_loss, acc=correct / count)
                window.zero_()
                t_window = now
            log.advance(1)
            if due_checkpoint and ctx.is_main:
                checkpoint.save(_state(cfg, model, optimizer, step, epoch), ckpt_path)
        ctx.synchronize()
        epoch_time = time.perf_counter() - t_epoch
        train_time += epoch_time
        if len(data.val[1]):
            val_acc, val_loss = evaluate(strategies.unwrap(model), data.val, prep, ctx, cfg.eval_batch_size)
        log.record(step=step, epoch=epoch + 1, val_accuracy=val_acc, val_loss=val_loss, epoch_time_s=epoch_time)
        log.say(f"epoch {epoch + 1}/{epochs}  val_accuracy {val_acc:.4f}  val_loss {val_loss:.4f}  "
                f"{epoch_time:.2f}s")
        t_window = time.perf_counter()  # evaluation is not training time

    test_acc, test_loss = evaluate(strategies.unwrap(model), data.test, prep, ctx, cfg.eval_batch_size)
    log.close()
    if not ctx.is_main:
        return None
    checkpoint.save(_state(cfg, model, optimizer, step, epochs), ckpt_path)
    summary = {
        "model": cfg.model, "dataset": cfg.dataset, "strategy": "ddp" if ctx.distributed else "single",
        "world_size": W, "global_batch_size": B, "steps": step, "epochs": epochs,
        "train_time_s": train_time, "examples_per_sec": steps_run * B / train_time if train_time else None,
        "test_accuracy": test_acc, "test_loss": test_loss,
        "val_accuracy": None if math.isnan(val_acc) else val_acc,
        "val_loss": None if math.isnan(val_loss) else val_loss,
        "seed": cfg.seed, "torch_version": torch.__version__, "devices": devices or [str(ctx.device)] * W,
        "run_dir": str(run_dir),
    }
    write_summary(run_dir, summary)
    return summary
