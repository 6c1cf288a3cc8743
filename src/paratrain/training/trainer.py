"""The one training loop. Every worker runs a Trainer; rank 0 writes and prints.

    Trainer.__init__   set-up: the strategy builds this worker's module; optimizer, schedule, EMA; resume
    Trainer.run        epochs: _train_epoch (steps), _validate, then _finish (test, checkpoint, summary)
    one step           _forward_backward (micro-batches) -> _agree (one tiny all-reduce) -> _update -> _after_update
    a stop signal      _leave: checkpoint, then raise Stopped (no evaluation)

What depends on the parallelism (how the model is split, wrapped, reduced, gathered, saved) is the
strategy's (strategies/); what a run changes as it goes is in one RunState.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.manager import RunCheckpoints
from ..checkpoint.run_folder import kept_after_failure
from ..components.adapt import models_loss
from ..components.build import make_batch_transforms, make_empty, memory_format, optimizer_parts
from ..components.parts import Parts
from ..config.length import step_seed
from ..core.errors import UserError, WriteFailed
from ..data import Splits
from ..data.batches import epoch_order, global_batch, order_device, worker_part
from ..data.feed import Feed, placed, reads_ahead
from ..features import float8, recompute
from ..features.dropout import has_dropout, masks
from ..optimization.evaluation import SUMS, step_sums
from ..optimization.losses import counted, evaluation_loss, has_ignored, loss_name, token_weights, training_loss
from ..optimization.metrics import Meter, for_run
from ..optimization.phases import PhaseTimer
from ..parallel import strategies
from ..parallel.runplan import RunPlan
from ..runtime.dist import DistContext
from ..runtime.interrupt import Stopped, StopRequest, signal_name
from ..tracking.log import RunLog, window_figures
from .state import (
    WARM_STEPS,
    RunRecord,
    RunState,
    compile_seconds,
    language_of,
    memory_figures,
    memory_held,
    pruned,
    quiet_compiler,
    summary_of,
    trained_figures,
)
from .stragglers import Stragglers, held_back


class Trainer:
    """One worker's training run: build it (from the checkpoint `saved` it carries on from), `run()` it once."""

    def __init__(self, ctx: DistContext, plan: RunPlan, saved: dict[str, Any] | None, checkpoints: RunCheckpoints,
                 stop: StopRequest | None = None, devices: list[str] | None = None, restarts: int = 0,
                 on_step: Callable[[int], None] | None = None) -> None:
        cfg, data = plan.cfg, plan.data
        self.ctx, self.cfg, self.stop_request, self.on_step = ctx, cfg, stop, on_step
        self.devices, self.restarts = devices, restarts
        self.parts = plan.parts or Parts()
        self.loss = self.parts.loss  # None: --loss (auto: cross-entropy for class indices, else the mse)
        # --loss model: the network's own, from the labels it is given (_set_up takes it from the network)
        self.own = self.loss is None and loss_name(cfg, data.categorical, data.labelled) == "model"
        self.eval_loss = self.loss if self.loss is not None or self.own else evaluation_loss(cfg, data.categorical)
        self.metrics = for_run(cfg.metric, self.parts.metrics, data)  # name -> metric, beside the loss
        self.per_target = self.loss is None and data.sequence and not self.own  # the built-in loss: a token mean
        self.padded, self.weight = (self.per_target or self.own) and has_ignored(data.train[1]), 1.0
        self.length, self.strategy = plan.length, strategies.get(cfg.strategy)(ctx, cfg, plan.layout)
        self.report, self.env = plan.report, plan.env
        self.writes_summary = not plan.launcher_writes_summary
        # Moved whole here; a memory-mapped dataset stays where it is and the feed reads each batch (on a GPU, the
        # next one ahead)
        self.data = placed(data, ctx.device, cfg.host_data)
        self.feed = Feed(self.data.train, ctx.device, reads_ahead(self.data.train, ctx.device))
        self.memory_at_start = memory_held(ctx.device)  # what the model and the steps add is measured from here
        self.state = self._set_up(data, saved)
        self.rows: Callable[[int], torch.Tensor | None] = lambda n: None  # the epoch's micro-batches (_train_epoch)
        self.prep = make_batch_transforms(cfg, self.data, ctx.device, self.strategy.channels_last)
        self.run_dir = Path(cfg.out)
        self.checkpoints = checkpoints
        self.log = RunLog(self.run_dir, ctx.is_main, cfg, self.length.total_steps, self.state.step,
                          self.state.validated, {"launcher": plan.env.launcher_name, "devices": str(ctx.world_size)},
                          strategies.unread_options(cfg))
        self.timer = PhaseTimer(ctx, cfg.time_phases, self.strategy.allreduce_timed)
        self.generator = ctx.generator()  # torch.manual_seed would also seed every GPU: ~0.2 ms a step
        self.window = torch.zeros(SUMS, dtype=torch.float64, device=ctx.device)  # evaluation.batch_sums' since log
        # the flags' divisors: the loss is summed over the workers that compute one; any worker's stop counts
        self.to_means = torch.tensor([self.strategy.batch_share[1], 1.0, 1.0], dtype=torch.float64, device=ctx.device)
        self.stragglers = Stragglers(ctx, self.strategy.waits_measurable)
        self.t_start = self.t_window = 0.0
        self.marks = {**plan.clock, "built": time.time()}  # start-up marks (clock.py); finish_s: _finish's phases
        self.finish_s: dict[str, float | None] = {}

    # ---- set-up ----

    def _set_up(self, data: Splits, saved: dict[str, Any] | None) -> RunState:
        cfg = self.cfg  # `saved`: read by this process (resume.py), its own to update in place
        torch.manual_seed(cfg.seed)  # (a network that cannot be drawn module by module draws itself from it)
        # on the meta device, each worker drawing its part of the weights once laid out (or reading --init-from's,
        whole, self.strategy.initial, self.strategy.drawn_whole = make_empty(  # but not where a checkpoint's follow)
            cfg if saved is None else cfg.replace(init_from=None), data, self.parts)
        if self.own:
            self.loss = self.eval_loss = models_loss(whole)
        self.language = language_of(whole, data, self.per_target)  # its FLOPs a token: before any sharding
        self.counts = counted if self.per_target else getattr(self.loss, "counts", None)  # a loss's mean is over
        self.drops = has_dropout(whole)  # then every micro-batch draws its masks as one device would
        # before any strategy wraps or splits it: a block keeps its parameters' names (recompute.py)
        recompute.apply(whole, cfg.activation_checkpointing, cfg.selective_ac)
        if cfg.precision == "float8":  # the linear layers swapped, their parameters kept (features/float8.py)
            float8.convert(whole)
        module = self.strategy.build(whole, data, self.loss or training_loss(cfg, data.categorical))
        if saved is not None:  # before the optimizer and the EMA are built over it: they start from these weights
            self.strategy.load(saved)
        # before DDP lays out its buckets and the EMA copies it
        if memory_format(cfg, self.strategy.channels_last) == torch.channels_last:
            module.to(memory_format=torch.channels_last)
        state = RunState(module, *optimizer_parts(cfg, module, self.parts, self.length.total_steps,
                                                  self.length.per_epoch, self.ctx.device),
                         self.strategy.average(cfg.ema) if cfg.ema else None)
        if saved is not None:
            self.strategy.restore(state.optimizer, state.ema, saved)  # the strategy's part, then the rest
            state.restore(saved, self.length.per_epoch, cfg.early_stopping)
        if cfg.compile:  # in place, after the weight average copied it: the same parameters and state_dict keys
            quiet_compiler(self.ctx.device.type)
            state.compile_start = compile_seconds()
            self.strategy.compile()
        self.strategy.wrap()
        return state

    # ---- the run ----

    def run(self) -> dict[str, Any] | None:
        """Train, evaluate, write the run directory. Returns the summary on rank 0, None elsewhere."""
        try:
            return self._run()
        except WriteFailed as e:  # a full disk, say: one line that says what was kept and how to go on
            raise WriteFailed(e.path, e.cause, kept_after_failure(self.run_dir, e.remedy())) from None

    def _run(self) -> dict[str, Any] | None:
        state, length = self.state, self.length
        try:
            self.t_start = self.t_window = time.perf_counter()
            self.strategy.model.train()
            if state.validated < min(state.step // length.per_epoch, length.epochs):  # saved before its validation
                self._validate(state.validated, 0.0)
            for epoch in range(state.step // length.per_epoch, length.epochs):
                if state.stop:  # --early-stopping decided at the validation just made up for
                    break
                epoch_time = self._train_epoch(epoch)
                if state.stop == "signal":
                    self._leave(epoch)
                self._validate(epoch, epoch_time)
                if state.stop:
                    break
            return self._finish()
        except BaseException:  # a NaN loss, a signal, a failed collective or write: flush the logs, keep the cause
            with contextlib.suppress(WriteFailed):
                self.log.close()
            raise
        finally:
            self.feed.close()

    def _train_epoch(self, epoch: int) -> float:
        """The epoch's steps (from a resumed step on); its training time."""
        state, length, ctx = self.state, self.length, self.ctx
        perm = epoch_order(self.data.train[1], self.cfg.seed, epoch).to(order_device(self.data.train, ctx.device))
        # micro-batch n of the epoch (of `accumulate` a step), this worker's share; None past the epoch's last step
        acc, (which, of) = self.cfg.accumulate, self.strategy.batch_share
        end = min(length.per_epoch, length.total_steps - epoch * length.per_epoch) * acc
        self.rows = lambda n: worker_part(global_batch(perm, n, self.cfg.batch_size), which, of) if n < end else None
        ctx.synchronize()
        t_epoch = time.perf_counter()
        for i in range(state.step - epoch * length.per_epoch,
                       min(length.per_epoch, length.total_steps - epoch * length.per_epoch)):
            time_up, asked = self._agree(self._forward_backward(perm, i))
            self._update()
            self._after_update(epoch)
            if state.steps_run == 1:
                ctx.synchronize()
                self.marks["first_step_done"] = time.time()
            if self.cfg.compile and state.steps_run == WARM_STEPS:  # compiled in these: apart from the rates
                ctx.synchronize()
                state.warmed(time.perf_counter() - t_epoch, compile_seconds())
            if asked:
                state.stop = "signal"
                break
            if time_up:
                state.stop = "time"
                break
        ctx.synchronize()
        epoch_time = time.perf_counter() - t_epoch
        state.train_time += epoch_time
        return epoch_time

    # ---- one step ----

    def _forward_backward(self, perm: torch.Tensor, i: int) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (--accumulate); the summed mean losses."""
        cfg, acc = self.cfg, self.cfg.accumulate
        # by the worker's share of the batch, not its rank: tensor parallelism's workers of a copy augment alike
        self.generator.manual_seed(step_seed(cfg.seed, self.state.step, self.strategy.batch_share[0]))
        t_start = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        which, of = self.strategy.batch_share
        batches = [global_batch(perm, i * acc + k, cfg.batch_size) for k in range(acc)]
        weights = token_weights(self.data.train[1], batches, which, of, self.own) if self.padded else [1.0] * acc
        for k in range(acc):
            with self.timer.phase("data"):
                x, y = self._fetch(i * acc + k)
            self.weight = weights[k]
            sync = k == acc - 1 and not self.timer.separates_allreduce  # then reduce_gradients all-reduces
            with self.timer.phase("compute"), masks(self.drops, self.strategy, self.cfg, self.state.step, k):
                loss, logits = self.strategy.forward_backward(x, y, sync, self._backward)
            if loss is None:  # a pipeline stage before the last
                continue
            step_loss += loss.detach().double()
            # read back at log steps only (no stall)
            self.window += step_sums(loss.detach(), logits.detach(), y, self.counts)
        self.stragglers.worked(t_start, self.strategy.gradients_ready_at())
        return step_loss

    def _fetch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The epoch's micro-batch `n`, transformed (the one place the loop reads the data: data/feed.py)."""
        x, y = self.feed.take(n, self.rows)
        return self.prep.train(x, self.generator), y

    def _backward(self, loss: torch.Tensor) -> None:
        # `weight`: the built-in loss's share of the step's counted tokens (losses.token_weights), where some
        # targets are not counted; the mean over the workers and micro-batches is then the step's token mean
        self.state.scaler.scale(loss * self.weight / self.cfg.accumulate).backward()

    def _agree(self, step_loss: torch.Tensor) -> tuple[bool, bool]:
        """One tiny all-reduce per update: every worker learns, before updating, whether any loss is
        non-finite, whether rank 0's clock ran out (--max-time), and whether any worker was asked to stop
        (SIGINT/SIGTERM), so they all stop at the same step. Returns (time up, asked to stop)."""
        cfg, ctx = self.cfg, self.ctx
        time_up = ctx.is_main and cfg.max_time is not None and time.perf_counter() - self.t_start > cfg.max_time
        asked = self.stop_request is not None and self.stop_request.signum != 0
        # filled on the device from a number (torch.tensor(f, device=...) copies from the host, a wait on a GPU)
        flag = [torch.full((), float(f), device=ctx.device, dtype=torch.float64) for f in (time_up, asked)]
        summed = self.stragglers.all_reduce(torch.stack([step_loss / cfg.accumulate, *flag]))
        mean_loss, time_flag, signal_flag = (summed / self.to_means).tolist()
        if not math.isfinite(mean_loss):
            self.checkpoints.wait()  # a good checkpoint still being written is kept whole (every worker is here)
            raise UserError(f"the loss became {mean_loss} at step {self.state.step + 1}; stopped before updating. "
                            f"Lower --lr; the last good checkpoint is kept in {self.checkpoints.folder}", code=3)
        return bool(time_flag), bool(signal_flag)

    def _update(self) -> None:
        """Reduce what the strategy left unreduced, then one optimizer step (and the EMA's)."""
        state, cfg = self.state, self.cfg
        self.strategy.reduce_gradients(self.timer)
        t_start = time.perf_counter()
        with self.timer.phase("optimizer"):
            if cfg.clip_grad_norm:
                state.scaler.unscale_(state.optimizer)
                self.strategy.clip_grad_norm(cfg.clip_grad_norm)
            state.scaler.step(state.optimizer)
            state.scaler.update()
            state.scheduler.step()
            if state.ema is not None:
                state.ema.update_parameters(state.model)
        self.stragglers.worked(t_start)  # told to the others at the next step's _agree
        self.timer.steps += 1
        state.step += 1
        state.steps_run += 1
        if self.on_step is not None:  # the launcher's record of where each worker is (launch._worker)
            self.on_step(state.step)

    def _after_update(self, epoch: int) -> None:
        state, cfg = self.state, self.cfg
        if cfg.histogram_every and state.step % cfg.histogram_every == 0:
            self.log.histograms(state.step, self.strategy.whole_parameters())  # a collective where sharded
        state.optimizer.zero_grad(set_to_none=True)
        if state.step % cfg.log_every == 0 or state.step == self.length.total_steps:
            self._log_step(epoch)
        self.log.advance()
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
            self._checkpoint(epoch)

    # ---- logging, checkpoints, evaluation ----

    def _log_step(self, epoch: int) -> None:
        """The training loss and accuracy since the last log line, over all workers (a collective)."""
        sums, now = self.ctx.all_reduce_sum(self.window).tolist(), time.perf_counter()
        self.log.step(step=self.state.step, epoch=epoch + 1, lr=self.state.optimizer.param_groups[0]["lr"],
                      **window_figures(sums, now - self.t_window, self.cfg.batch_size * self.cfg.accumulate,
                                       self.data.tokens_per_example, self.per_target))
        self.window.zero_()
        self.t_window = now

    def _agree_buffers(self) -> None:
        """Every worker takes the buffers that rank 0 holds and saves (BatchNorm's running statistics, which
        --batchnorm local lets drift apart), so an evaluation split over the workers judges the saved network.
        Training never reads them, so this changes no step."""
        self.strategy.agree_buffers(self.state.model)
        if self.state.ema is not None:
            self.strategy.agree_buffers(self.state.ema.module)

    def _checkpoint(self, epoch: int, last: bool = False) -> None:
        """Save the run's state (a collective: the strategy decides who writes what); `last`: the run's last save,
        waited for to the end wherever it is written in the background."""
        state, t_start = self.state, time.perf_counter()
        self._agree_buffers()
        extras = lambda: state.extras(epoch, self.cfg.to_dict(), self.data.shape_info(), self.parts.record)  # noqa: E731
        self.strategy.save(state.optimizer, state.ema, extras, self.checkpoints, state.step, self.cfg.keep_checkpoints)
        if last:
            self.checkpoints.wait()
        state.saved_step = state.step
        state.checkpoint_wait += time.perf_counter() - t_start

    def _leave(self, epoch: int) -> None:
        """Stopped by a signal: save what was done and leave quickly, without evaluating."""
        if self.state.saved_step != self.state.step:
            self._checkpoint(epoch, last=True)
        self.checkpoints.wait()  # this step's, where it was begun in the background before
        signum = self.stop_request.signum if self.stop_request is not None and self.stop_request.signum else \
            signal.SIGTERM
        raise Stopped(f"stopped by {signal_name(signum)} at step {self.state.step}; the checkpoint is in "
                      f"{self.checkpoints.folder}; continue with --resume {self.run_dir}", signum)

    def _evaluate(self, pair: tuple[torch.Tensor, torch.Tensor], ema: bool = False) -> tuple[float, float, dict]:
        """Accuracy, loss and metrics of the model being trained (the strategy evaluates it where it lies), or
        of its weight average; the loss is the user's, the plain cross-entropy (evaluation.batch_sums' None), or
        the mean squared error."""
        cfg, meter = self.cfg, Meter(self.metrics, self.ctx.device) if self.metrics else None
        if ema:
            acc, loss = self.strategy.evaluate_average(self.state.ema, pair, self.prep, cfg.eval_batch_size,
                                                       self.eval_loss, cfg.test_flip, meter)
        else:
            acc, loss = self.strategy.evaluate(pair, self.prep, cfg.eval_batch_size, self.eval_loss, cfg.test_flip,
                                               meter)
        return acc, loss, meter.values(self.ctx) if meter is not None else {}

    def _validate(self, epoch: int, epoch_time: float) -> None:
        state, t_eval = self.state, time.perf_counter()
        self._agree_buffers()
        if len(self.data.val[1]):
            state.val = self._evaluate(self.data.val, ema=self.cfg.eval_ema)
        state.eval_time += time.perf_counter() - t_eval
        self.log.epoch(step=state.step, epoch=epoch + 1, epochs=self.length.epochs, val_accuracy=state.val[0],
                       val_loss=state.val[1], epoch_time_s=epoch_time, validated=bool(len(self.data.val[1])),
                       **{f"val_{name}": value for name, value in state.val[2].items()})
        # a whole epoch's validation counts (a --max-time or signal stop in mid-epoch is validated again,
        # whole, when the run is resumed)
        if state.step >= min((epoch + 1) * self.length.per_epoch, self.length.total_steps):
            state.validated = epoch + 1
            state.watch_val_loss(self.cfg.early_stopping)
            if self.report is not None and pruned(self.ctx, self.report, epoch, state.val, self.per_target):
                state.stop = state.stop or "pruned"
        self.t_window += time.perf_counter() - t_eval  # evaluation is not training time: the window skips it

    def _record(self) -> RunRecord:
        ctx, parts, classes = self.ctx, self.parts, self.data.classes
        return RunRecord(self.cfg, parts.model_name() if parts.model is not None else self.cfg.model,
                         self.length.per_epoch, self.devices or [str(ctx.device)] * ctx.world_size, self.run_dir,
                         self.env, self.restarts, parts.record or None, list(classes) if classes else None,
                         self.marks, self.finish_s, self.timer.per_step(), self.language)

    def _finish(self) -> dict[str, Any] | None:
        """Test, save the last checkpoint, and (rank 0) write the summary."""
        state, t_eval = self.state, time.perf_counter()
        self._agree_buffers()
        test = self._evaluate(self.data.test)
        # the weight average judged on both held-out sets (every task's figures: loss, accuracy, metrics)
        state.val_ema, test_ema = (self._evaluate(s, ema=True) if state.ema is not None and len(s[1]) else None
                                   for s in (self.data.val, self.data.test))
        state.eval_time += time.perf_counter() - t_eval
        t_saved = time.perf_counter()
        # once: where the last step's periodic save wrote it, that one stands (its record of the last validation
        # is one behind: a resume of it validates that epoch again, as for any checkpoint saved before one)
        if state.saved_step != state.step:
            self._checkpoint(self.length.epochs, last=True)
        self.checkpoints.wait()
        t_logs = time.perf_counter()
        self.log.close()
        self.finish_s = {"evaluation": t_saved - t_eval, "checkpoint": t_logs - t_saved,
                         "logs": time.perf_counter() - t_logs, "shutdown": None}  # shutdown: the launcher's to time
        added = self.strategy.summary()  # a collective for some strategies: every worker calls it
        waits = {**self.stragglers.figures(state.train_time),
                 **memory_figures(state.model, state.optimizer, self.ctx, self.memory_at_start)}  # a collective
        if not self.ctx.is_main:
            return None
        summary = {**summary_of(state, self._record(), test, test_ema, added), **waits}
        if state.steps_run == 0:  # a finished run evaluated again: its training's figures are the earlier start's
            summary.update(trained_figures(self.run_dir, state.step))
        if held_back(summary, state.train_time):
            self.log.say(held_back(summary, state.train_time))
        self.log.finish(summary, self.writes_summary)  # else the launcher's session writes it, with its last figures
        return summary
