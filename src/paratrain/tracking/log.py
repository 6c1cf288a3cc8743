"""What rank 0 writes about a run: metrics.jsonl, TensorBoard events, console lines, a progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..config import TrainConfig
from ..config.fields import loggers
from ..core.optional import how_to_install, installed
from ..core.outputs import write_atomic, writing
from ..core.run_paths import RunPaths
from ..runtime.interrupt import Stopped
from .trackers import Trackers, identity, named


def _clean(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}


def _before_checkpoint(line: str, step: int, validated: int) -> bool:
    """Whether a metrics.jsonl record comes from before the checkpoint of `step`, which had validated
    `validated` epochs: a step record up to that step, an epoch record of a validated epoch. Not a line that
    is not a record (a torn last line, say)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    if not isinstance(record, dict) or record.get("step", 0) > step:
        return False
    # a checkpoint at an epoch's last step is written before that epoch's validation, which the resumed run
    # makes again: its old line goes
    return "epoch_time_s" not in record or record.get("epoch", 0) <= validated


class RunLog:
    """Every method is a no-op off rank 0, so the loop can call them unconditionally."""

    def __init__(self, run_dir: Path, active: bool, cfg: TrainConfig, total_steps: int, start_step: int,
                 validated: int = 0, tags: dict[str, str] | None = None, unread: Iterable[str] = ()) -> None:
        """`tags`: the launch's, for the trackers (launcher, devices); `unread`: the options the run does not read,
        left out of the trackers' params as config.yaml leaves them out."""
        self.active = active
        self.quiet = cfg.quiet
        self.no_val_flag = cfg.val_size == 0  # (paratrain.fit may be given an empty validation set instead)
        self.total_steps = total_steps
        self.path = RunPaths(run_dir).metrics
        self.bar = None
        self.tb = None
        self.trackers: Trackers | None = None
        if not active:
            return
        # tqdm's default lock includes a multiprocessing RLock, a semaphore that a worker leaving through
        # os._exit (launch.end_process) never releases: "resource_tracker: ... 1 leaked semaphore" at the end
        # of every run. Only this process writes the console here, so a thread lock is enough.
        tqdm.set_lock(threading.RLock())
        self.tb_dir, self.run_dir = RunPaths(run_dir).tensorboard, run_dir
        with writing(self.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            kept = self._truncate_after(start_step, validated)
            # appended to, so not renamed: O_NOFOLLOW refuses a link planted in its place
            self.file = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644),
                                  "a")
        chosen = loggers(cfg)
        if named(cfg.logger):  # a tracker's warning is shown --quiet or not
            left_out = set(unread)
            params = {k: v for k, v in cfg.to_dict().items() if k not in left_out}  # config.yaml's
            self.trackers = Trackers(run_dir, named(cfg.logger), identity(run_dir, params, tags), self.say,
                                     cfg.mlflow_uri, have=kept, warn=lambda line: tqdm.write(line, file=sys.stderr))
        if "tensorboard" in chosen and not installed("tensorboard"):  # the run goes on: metrics.jsonl has all
            self.say(f"paratrain: note: no TensorBoard event files: the tensorboard package is not installed "
                     f"({how_to_install('tensorboard')}); metrics.jsonl holds every figure")
        elif "tensorboard" in chosen:
            from torch.utils.tensorboard import SummaryWriter  # imported only where it is used: ~1 s

            with writing(self.tb_dir):
                self.tb = SummaryWriter(str(self.tb_dir), purge_step=start_step + 1 if start_step else None)
        if not cfg.quiet and sys.stderr.isatty():  # a log file gets the plain step and epoch lines only
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            mininterval=0.5)

    def _truncate_after(self, step: int, validated: int) -> int:
        """On resume, drop the records a killed run wrote after its last checkpoint (of `step`, `validated`
        epochs validated); how many are kept."""
        try:  # O_NOFOLLOW: a link in its place is refused (core/outputs.check_owned says so before launch)
            with os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return 0
        kept = [line for line in lines if _before_checkpoint(line, step, validated)]
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        return len(kept)

    def _write(self, fields: dict[str, Any]) -> None:
        with writing(self.path):
            self.file.write(json.dumps(_clean(fields)) + "\n")
            self.file.flush()
        if self.trackers is not None:
            self.trackers.record(_clean(fields))

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard's writer writes in a thread of its own and raises a failed write at a later call."""
        with writing(self.tb_dir):
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)

    def say(self, line: str) -> None:
        """A console line that does not break the progress bar."""
        if self.active and not self.quiet:
            tqdm.write(line)

    def step(self, *, step: int, sec_per_batch: float, **fields: Any) -> None:
        """The tutorials' per-step line: step, loss, training accuracy, examples/sec, sec/batch."""
        if not self.active:
            return
        self._write({"step": step, **fields})
        acc = fields["train_accuracy"]  # None where the task has no classes (a regression)
        rate = f"{fields['tokens_per_sec']:,.0f} tokens/sec" if "tokens_per_sec" in fields else \
            f"{fields['examples_per_sec']:,.0f} examples/sec"
        self.say(f"step {step}/{self.total_steps}  loss {fields['loss']:.4f}  "
                 + (f"train_accuracy {acc:.4f}  " if acc is not None else "")
                 + (f"perplexity {fields['perplexity']:.2f}  " if "perplexity" in fields else "")
                 + f"{rate}  {sec_per_batch:.3f} sec/batch  lr {fields['lr']:.3g}")
        if self.bar is not None:
            shown = {"loss": f"{fields['loss']:.4g}", **({"acc": f"{acc:.4f}"} if acc is not None else {})}
            self.bar.set_postfix(**shown, refresh=False)
        if self.tb is not None:
            self._scalars(step, {f"train/{key}": fields[key] for key in ("loss", "train_accuracy", "lr",
                                                                         "examples_per_sec", "tokens_per_sec")
                                 if fields.get(key) is not None})

    def epoch(self, *, step: int, epoch: int, epochs: int, validated: bool = True, **fields: Any) -> None:
        """The epoch's line; `validated`: there is a validation set (none with --val-size 0)."""
        if not self.active:
            return
        self._write({"step": step, "epoch": epoch, **fields})
        acc, loss = fields["val_accuracy"], fields["val_loss"]  # accuracy NaN: a task without classes
        val = ((f"val_accuracy {acc:.4f}  " if not math.isnan(acc) else "") + f"val_loss {loss:.4f}" if validated
               else "no validation set" + (" (--val-size 0)" if self.no_val_flag else ""))
        metrics = {k[4:]: v for k, v in fields.items()
                   if k.startswith("val_") and k not in ("val_accuracy", "val_loss")}
        val += "".join(f"  val_{k} {v:.4f}" for k, v in metrics.items()) if validated else ""
        self.say(f"epoch {epoch}/{epochs}  {val}  {fields['epoch_time_s']:.2f}s")
        if self.tb is not None and validated:
            shown = {"accuracy": acc, "loss": loss, **metrics}
            self._scalars(step, {f"val/{k}": v for k, v in shown.items() if not (k == "accuracy" and math.isnan(v))})

    def histograms(self, step: int, parameters: Iterable[tuple[str, torch.Tensor, torch.Tensor | None]]) -> None:
        """TensorBoard histograms of (name, weight, gradient) triples (Strategy.whole_parameters), drawn where
        this worker writes TensorBoard; every worker takes every triple (gathering one is a collective)."""
        with writing(self.tb_dir) if self.tb is not None else contextlib.nullcontext():
            for name, weight, grad in parameters:
                if self.tb is not None:
                    self.tb.add_histogram(f"weights/{name}", weight.float().cpu(), step)
                    if grad is not None:
                        self.tb.add_histogram(f"gradients/{name}", grad.float().cpu(), step)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def finish(self, summary: dict[str, Any], write: bool) -> None:
        """Rank 0, after close: summary.json written (`write`: no launcher's session will), and the trackers' runs
        ended as finished, with the summary and the run's files."""
        if write:
            write_summary(self.run_dir, summary)
        if self.trackers is not None:
            self.trackers.finish(summary)

    def close(self) -> None:
        """Flush and close (once). A failed flush still closes the files, then raises WriteFailed. Called while an
        exception is handled, the trackers' runs end too: killed by a stop, else failed."""
        if not self.active or self.file.closed:
            return
        failed = sys.exc_info()[1]
        if failed is not None and self.trackers is not None:
            self.trackers.finish(None, "KILLED" if isinstance(failed, Stopped | KeyboardInterrupt) else "FAILED")
        if self.bar is not None:
            self.bar.close()
        try:
            if self.tb is not None:
                with writing(self.tb_dir):
                    self.tb.close()
        finally:
            with writing(self.path):
                self.file.close()  # closed even when its last flush fails


def window_figures(sums: list[float], elapsed: float, per_update: int, tokens: int | None,
                   per_target: bool) -> dict[str, Any]:
    """The training figures of a log window from its summed slots (evaluation.SUMS: loss sum, correct,
    examples, classified examples, what the loss is a mean over): the loss, accuracy (None without classes),
    examples/s and s a batch; tokens/s (`tokens`: a sequence model's tokens an example) and the perplexity
    (`per_target`: the built-in cross-entropy over tokens)."""
    from ..optimization.losses import perplexity

    loss_sum, correct, count, with_class, weight = sums
    return {"loss": loss_sum / weight, "examples_per_sec": count / elapsed,
            "train_accuracy": correct / with_class if with_class else None, "time_s": elapsed,
            "sec_per_batch": elapsed * per_update / count,
            **({"tokens_per_sec": count * tokens / elapsed} if tokens else {}),
            **({"perplexity": perplexity(loss_sum / weight)} if per_target else {})}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    write_atomic(RunPaths(run_dir).summary, json.dumps(_clean(summary), indent=2) + "\n")
