"""Experiment trackers beside metrics.jsonl (--logger csv, mlflow, wandb): rank 0 sends a run's options, every
figure of its records and its summary to each, through the trackers' own clients.

A tracker that fails (a server that refuses, times out or is gone) is one warning line and is then left alone: the
run goes on, metrics.jsonl keeps every figure, and `paratrain log RUN --logger NAME` sends them afterwards (from
the first record the tracker did not take). The tracker runs a run logs into are kept in RUN_DIR/trackers.json,
so a resumed or requeued run logs into the same MLflow or W&B run. No secret is printed or kept: a tracking URI
is shown with its password masked, a W&B key is W&B's own to read."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.fields import TrainConfig, loggers
from ..core.background import BatchSender
from ..core.outputs import write_atomic
from ..core.run_paths import RunPaths
from ..core.urls import masked, scrubbed
from .tracker_files import kept, read_json, records, write_csv

# each tracker run's artifacts (a bench adds its pictures), and summary.json: the summary rank 0 ends with (the
# file the launcher then writes adds how long the workers took to leave, and --devices auto's choice)
# MLflow reads the bounds of its HTTP requests only from the environment (retries 7, backoff x2, 120 s timeout by
# default: minutes of a stalled training per call when a server is gone); a user's own setting wins
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "15", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
SUMMARY = ("examples_per_sec", "tokens_per_sec", "mfu", "train_time_s", "final_lr")  # the run's own, at its end
# a summary's numbers that are no figure of the run: its settings (the run's params and tags hold them), a clock
SETTINGS = ("seed", "world_size", "global_batch_size", "ended_at")
STATES = ("FINISHED", "FAILED", "KILLED")  # how a tracker run ends (MLflow's words)


@dataclass
class Identity:
    """What a tracker run is called and holds from the start: its experiment (W&B: project), its name (the run
    folder's), the options as params, tags (strategy, mesh, devices, launcher), and where a search or bench
    puts it: `parent`, an MLflow run id (W&B: `group`)."""

    experiment: str
    name: str
    params: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)
    parent: str | None = None
    group: str | None = None


def identity(run_dir: Path, options: dict[str, Any], tags: dict[str, str] | None = None) -> Identity:
    """A run's identity from its resolved options (config.yaml's) and the tags its launch adds."""
    experiment = options.get("experiment") or Path(run_dir).resolve().parent.name or "paratrain"
    own = {k: str(options[k]) for k in ("strategy", "mesh") if options.get(k)}  # a search's or bench's: none
    return Identity(experiment, Path(run_dir).resolve().name, options, {**own, **(tags or {})})


def named(logger: str | None) -> tuple[str, ...]:
    """The trackers a --logger value names beside TensorBoard (which a run writes as it trains, tracking/log.py)."""
    return tuple(n for n in loggers(TrainConfig(logger=logger or "none")) if n != "tensorboard")


def figures(record: dict[str, Any]) -> dict[str, float]:
    """A record's figures: its finite numbers (not the step, not a flag or a list)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, int | float)
            and not isinstance(v, bool) and math.isfinite(v)}


def end_figures(summary: dict[str, Any], logged: Iterable[str] = ()) -> dict[str, float]:
    """Every figure of the summary, which a tracker compares runs by (a language model's validation perplexity and
    bits per byte with the rest), but those `logged` over the run (metrics.jsonl's: a validation loss is its last
    epoch's record); the test figures and the run's own rates, time and rate of learning whatever was logged."""
    logged = set(logged)
    return {k: v for k, v in figures(summary).items()
            if k not in SETTINGS and (k.startswith("test_") or k in SUMMARY or k not in logged)}


class Tracker:
    """One tracker run: opened (a new one, or the kept one), then given figures, files, and its end."""

    name = ""

    def open(self, ident: Identity, kept: dict[str, Any]) -> dict[str, Any]:
        """Open the run (`kept`: what trackers.json kept of it); what to keep to find it again."""
        return {}

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, files: list[Path], summary: dict[str, Any] | None, state: str,
               final: dict[str, float] | None = None) -> None: ...

    def where(self) -> str:
        return ""

    def pending(self) -> int:
        """Records `log` took that have not reached the tracker (a tracker that sends them in the background)."""
        return 0


class CsvTracker(Tracker):
    """RUN_DIR/metrics.csv: metrics.jsonl as a table (a column per figure), rewritten at each epoch and the end."""

    name = "csv"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def log(self, step: int, values: dict[str, float]) -> None:
        if "epoch_time_s" in values:  # an epoch's record (a step's holds its epoch too)
            write_csv(self.run_dir)

    def finish(self, files: list[Path], summary: dict[str, Any] | None, state: str,
               final: dict[str, float] | None = None) -> None:
        write_csv(self.run_dir)

    def where(self) -> str:  # a folder with records to tabulate (a bench's own has none: its runs' have)
        paths = RunPaths(self.run_dir)
        return str(paths.metrics_csv) if paths.metrics.is_file() else ""


class MlflowTracker(Tracker):
    """An MLflow run, through MlflowClient (no global active run: a search's process logs many). Its records go
    to the server from a thread of their own, in batches: the client's requests are synchronous (12.6 ms a record
    on loopback in the training loop, benchmarks/tracker_overhead.py), and a remote server's round trip would
    slow every logged step. A failed request is raised by the next `log` or by `finish`."""

    name = "mlflow"
    BATCH = 1000  # metrics per request: every MLflow server's limit
    EVERY_S = 1.0  # a request at most this often (the records of that second in one): the server's work is per request

    def __init__(self, uri: str | None) -> None:
        for key, value in MLFLOW_BOUNDS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient  # ~2.5 s: imported only where a run logs to MLflow

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its "Creating ... tables" lines

        self.client = MlflowClient(tracking_uri=uri)  # None: $MLFLOW_TRACKING_URI, else MLflow's default here
        self.uri = self.client.tracking_uri
        self.run_id = ""
        self.logged: dict[str, int] = {}  # a run taken up again: each figure's last step the server holds
        self.sender = BatchSender(self._post, self.EVERY_S, self.BATCH, size=len, name="paratrain-mlflow")

    def open(self, ident: Identity, kept: dict[str, Any]) -> dict[str, Any]:
        from mlflow.entities import Param

        if kept.get("run_id"):  # a resumed or requeued run: the same MLflow run, running again
            self.run_id = kept["run_id"]
            if kept.get("behind"):  # it failed: its records from where it stopped are sent again
                self.logged = self._logged_steps()
            self.client.update_run(self.run_id, status="RUNNING")
            return self._kept()
        found = self.client.get_experiment_by_name(ident.experiment)
        experiment = found.experiment_id if found else self.client.create_experiment(ident.experiment)
        tags = {**ident.tags, **({"mlflow.parentRunId": ident.parent} if ident.parent else {})}
        self.run_id = self.client.create_run(experiment, run_name=ident.name, tags=tags).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in ident.params.items()]  # 500: every MLflow server's limit
        for start in range(0, len(params), 100):  # a request holds at most 100 params
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        return self._kept()

    def _kept(self) -> dict[str, Any]:
        """The run's id, and the store it is in unless its URI holds a password (which no file keeps): MLflow's
        default store is the current folder's, and a resume started elsewhere must still find the run."""
        uri = self.uri  # a relative SQLite store (the docs' sqlite:///mlflow.db) made absolute, as the default's is
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
        return {"run_id": self.run_id, **({"uri": uri} if masked(uri) == uri else {})}

    def _logged_steps(self) -> dict[str, int]:
        """Each figure's last step in a run that failed, taken up again: a request the server took as it stopped,
        its answer lost, was counted unsent, and `paratrain log` (or the run carried on) sent its records twice.
        One request: a run's latest metrics are the ones of its highest steps."""
        return {m.key: m.step for m in self.client.get_run(self.run_id).data.to_proto().metrics}

    def _new(self, step: int, values: dict[str, float]) -> list[Any]:
        """The figures of `values` the run does not hold at `step` yet, as metrics."""
        return _metrics(step, {k: v for k, v in values.items() if step > self.logged.get(k, -1)})

    def log(self, step: int, values: dict[str, float]) -> None:
        if metrics := self._new(step, values):
            self.sender.put(metrics)

    def _post(self, records: list[list[Any]]) -> None:
        """A request with the records the sender's thread gathered (whole records, BATCH metrics at most)."""
        self.client.log_batch(self.run_id, metrics=[metric for record in records for metric in record])

    def pending(self) -> int:
        return self.sender.unsent

    def finish(self, files: list[Path], summary: dict[str, Any] | None, state: str,
               final: dict[str, float] | None = None) -> None:
        self.sender.close()
        for path in files:  # before the end's figures: a retry after a failure here sends those once
            self.client.log_artifact(self.run_id, str(path))
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "summary.json")
        if final:  # at the last step, as metrics (W&B keeps them as the run's summary)
            self._post([_metrics((summary or {}).get("steps") or 0, final)])
        self.client.set_terminated(self.run_id, state)

    def where(self) -> str:
        return f"MLflow run {self.run_id} at {masked(self.uri)}"


def _metrics(step: int, values: dict[str, float]) -> list[Any]:
    """A record's figures as MLflow metrics at `step`, stamped now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, v, now, step) for k, v in values.items()]


class WandbTracker(Tracker):
    """A W&B run in the mode W&B users set (WANDB_MODE=offline: no network); its files under RUN_DIR/wandb."""

    name = "wandb"

    def __init__(self, run_dir: Path) -> None:
        import wandb  # imported only where a run logs to W&B

        self.wandb, self.run_dir, self.run = wandb, run_dir, None

    def open(self, ident: Identity, kept: dict[str, Any]) -> dict[str, Any]:
        settings = self.wandb.Settings(console="off", silent=True)  # paratrain's own lines stay the console's
        self.run = self.wandb.init(project=ident.experiment, name=ident.name, id=kept.get("id"), resume="allow",
                                   dir=str(self.run_dir), config=ident.params, group=ident.group,
                                   tags=[f"{k}={v}" for k, v in ident.tags.items() if v], reinit="create_new",
                                   settings=settings)
        self.run.define_metric("*", step_metric="step")  # steps may repeat after a resume: an axis of its own
        return {"id": self.run.id}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def finish(self, files: list[Path], summary: dict[str, Any] | None, state: str,
               final: dict[str, float] | None = None) -> None:
        import shutil

        self.run.summary.update(final or {})
        if summary:
            (Path(self.run.dir) / RunPaths(self.run_dir).summary.name).write_text(json.dumps(summary, indent=2) + "\n")
        for path in files:  # a copy in the run's own folder is uploaded with it (wandb.save would link, and warn)
            shutil.copy(path, Path(self.run.dir) / path.name)
        self.run.finish(exit_code=0 if state == "FINISHED" else 1)

    def where(self) -> str:
        return f"W&B run {self.run.id} ({self.run.settings.mode}) in {RunPaths(self.run_dir).wandb}"


def _make(name: str, run_dir: Path, uri: str | None) -> Tracker:
    """(config/checks.py refused a tracker whose client is not installed, before any run started.)"""
    return {"csv": lambda: CsvTracker(run_dir), "mlflow": lambda: MlflowTracker(uri),
            "wandb": lambda: WandbTracker(run_dir)}[name]()


class Trackers:
    """The run's trackers, each opened, fed and ended here; any failure of one is one line (`say`) and its end."""

    def __init__(self, run_dir: Path, names: Iterable[str], ident: Identity, say: Callable[[str], None],
                 uri: str | None = None, have: int = 0, warn: Callable[[str], None] | None = None) -> None:
        """`say`: where a line goes (which tracker run a run logs into), `warn`: a failure's (default: say's).
        `have`: the records metrics.jsonl holds now (a resumed run's, those before its checkpoint): a kept
        tracker run has them all, unless it failed at an earlier one ("sent" in trackers.json)."""
        self.kept = kept(run_dir)
        if uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):  # the store the run logged to before
            uri = self.kept.get("mlflow", {}).get("uri")
        self.run_dir, self.say, self.uri, self.warn = run_dir, say, uri, warn or say
        self.failures: dict[str, str] = {}  # tracker: why it failed
        self.live: list[Tracker] = []
        self.count: dict[str, int] = {}
        for name in names:  # named()'s: no tensorboard
            tracker = self._guard(name, lambda n=name: _make(n, run_dir, uri))
            known = {k: v for k, v in self.kept.get(name, {}).items() if k != "sent"}
            # it failed before: its records are sent again from where it stopped (MlflowTracker.open)
            told = {**known, "behind": True} if known and "sent" in self.kept[name] else known
            opened = None if tracker is None else self._guard(name, lambda t=tracker, k=told: t.open(ident, k))
            if opened is None:  # a kept run not reached: `paratrain log` sends it what this start adds
                self.kept[name] = {**known, "sent": min(self.kept[name].get("sent", have), have)} if known else {}
                continue
            self.count[name] = min(self.kept[name].get("sent", have), have) if known else 0
            self.kept[name] = opened
            self.live.append(tracker)
            if tracker.where():
                say(f"paratrain: logging to {tracker.where()}")
        self._save()

    def _guard(self, name: str, call: Callable[[], Any]) -> Any:
        """`call`'s result, or None after one warning line (the tracker is then left out)."""
        from ..core.errors import UserError

        try:
            return call()
        except UserError:
            raise
        except Exception as e:  # a client's error: connection refused, a timeout, a server's 5xx, a full disk
            store = self.uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default store in this folder"
            why = scrubbed(_why(e), store) + (f" at {masked(store)}" if name == "mlflow" else "")
            self.failures[name] = why
            self.warn(f"paratrain: warning: --logger {name} failed ({why}); the run goes on without it and "
                     f"metrics.jsonl keeps every figure: `paratrain log {self.run_dir} --logger {name}` sends "
                     "them later")
            self.live = [t for t in self.live if t.name != name]
            return None

    def _save(self) -> None:
        write_atomic(RunPaths(self.run_dir).trackers, json.dumps(self.kept, indent=1) + "\n")

    def record(self, record: dict[str, Any]) -> None:
        """One record of metrics.jsonl, to every tracker (its figures at its step)."""
        for tracker in list(self.live):
            self._send(tracker, record)

    def _send(self, tracker: Tracker, record: dict[str, Any]) -> None:
        if self._guard(tracker.name, lambda: tracker.log(record.get("step", 0), figures(record)) or 1) is None:
            self._save_sent(tracker)
        else:
            self.count[tracker.name] += 1

    def replay(self, found: list[dict[str, Any]]) -> None:
        """metrics.jsonl's records `found`, each tracker from the first it has not taken."""
        for tracker in list(self.live):
            for record in found[self.count[tracker.name]:]:
                if tracker in self.live:
                    self._send(tracker, record)

    def _save_sent(self, failed: Tracker) -> None:
        """Where `paratrain log` takes the failed tracker up: after the records it took (not those it had queued)."""
        self.kept.setdefault(failed.name, {})["sent"] = self.count[failed.name] - failed.pending()
        self._save()

    def finish(self, summary: dict[str, Any] | None, state: str = "FINISHED", extra: Iterable[Path] = (),
               final: dict[str, float] | None = None) -> None:
        """The end of every tracker run: the summary's figures, the run's files, its state (STATES)."""
        files = [p for p in (RunPaths(self.run_dir).config, RunPaths(self.run_dir).parts) if p.is_file()] + list(extra)
        logged = {k for record in records(self.run_dir) for k in record}
        final = {**end_figures(summary or {}, logged), **(final or {})}
        for tracker in list(self.live):
            if self._guard(tracker.name, lambda t=tracker: t.finish(files, summary, state, final) or 1) is None:
                self._save_sent(tracker)
            else:  # a second `paratrain log` has nothing to send it
                self.kept[tracker.name]["ended"] = state
        self.live = []
        self._save()


def _why(error: Exception) -> str:
    """A client's error in a few words: the socket's own (a refused or unknown host under urllib3's and MLflow's
    wrapping, a 300-character line), else its first line, cut at a word."""
    text = f"{type(error).__name__}: {error}"
    low = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text) or re.search(r"(Read timed out|timed out)", text)
    if low:
        return f"{type(error).__name__}: {low.group(1).strip()}"
    first = text.splitlines()[0]
    return first if len(first) <= 200 else first[:200].rsplit(" ", 1)[0] + " ..."


def send(run_dir: Path, names: Iterable[str], say: Callable[[str], None], *, warn: Callable[[str], None] | None = None,
         uri: str | None = None, tags: dict[str, str] | None = None, parent: str | None = None,
         group: str | None = None, experiment: str | None = None, options: dict[str, Any] | None = None,
         state: str = "FINISHED", final: dict[str, float] | None = None, extra: Iterable[Path] = (),
         name: str | None = None) -> dict[str, str]:
    """A run folder's records to trackers after the fact (`paratrain log`, a search's trials, a bench's rows):
    into the tracker runs it kept (from the first record they did not take), or new ones. `options`: where the
    run wrote no config.yaml (a trial refused before it started); `final`: figures of the caller's (a trial's
    objective), logged at the end; `name`: the tracker run's, where not the folder's. Returns the trackers that
    failed, with why."""
    import yaml

    if options is None:
        options = yaml.safe_load(RunPaths(run_dir).config.read_text()) or {}
    summary = read_json(RunPaths(run_dir).summary)  # where it ran: the tags a run's launch gives (devices, launcher)
    ran = {k: str(summary[s]) for k, s in (("devices", "world_size"), ("launcher", "launcher")) if s in (summary or {})}
    options = {**options, **({"experiment": experiment} if experiment else {})}
    ident = identity(run_dir, options, {**ran, **(tags or {})})
    ident.parent, ident.group, ident.name = parent, group, name or ident.name
    found = records(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # trackers.json's, for a run refused before it wrote a file
    trackers = Trackers(run_dir, names, ident, say, uri or options.get("mlflow_uri"), have=len(found), warn=warn)
    trackers.replay(found)
    trackers.finish(summary, state if summary is not None or state != "FINISHED" else "KILLED", extra, final)
    return trackers.failures
