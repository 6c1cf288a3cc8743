"""Experiment trackers (--logger csv, mlflow, wandb): a real `mlflow server` on loopback for training on 2
workers, a resume, a search's parent and child runs, a server stopped mid-run and `paratrain log` afterwards;
W&B in its offline mode, read back from its own run file."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import crashing_model, free_port, main_code, run_cli, training_workers, wait_for

from paratrain.tracking import trackers

if importlib.util.find_spec("mlflow") is None:  # imported where a test reads a store, not by collecting (2.8 s)
    pytest.skip("the mlflow package is not installed (pip install 'paratrain[mlflow]')", allow_module_level=True)
HEAVY_IMPORT = "mlflow"  # the fast tests of this file share one test process, which imports it (conftest.py)


class Server:
    """`mlflow server` on 127.0.0.1 over a SQLite store in `folder`: stopped and started again on the same store."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = folder, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [shutil.which("mlflow") or str(Path(sys.executable).parent / "mlflow"), "server", "--host",
                   "127.0.0.1", "--port", str(self.port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{self.folder / 'store.db'}",
                   "--artifacts-destination", str(self.folder / "artifacts")]
        log = open(self.folder / "server.log", "a")  # noqa: SIM115 (the server's for its life)
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        raise AssertionError("mlflow server did not answer within 120 s")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def client(self) -> Any:  # an mlflow.MlflowClient
        import mlflow

        return mlflow.MlflowClient(self.uri)

    def runs(self, experiment: str) -> list:
        found = self.client().get_experiment_by_name(experiment)
        return self.client().search_runs([found.experiment_id]) if found else []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    serving = Server(tmp_path_factory.mktemp("mlflow"))
    serving.start()
    yield serving
    serving.stop()


def _cli(uri: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "paratrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.integration
def test_a_run_on_two_workers_is_one_mlflow_run_and_its_resume_adds_to_it(server: Server, tmp_path: Path) -> None:
    run = tmp_path / "two-workers" / "run"
    proc = _cli(server.uri, "train", "--logger", "mlflow", "--devices", "2", "--epochs", "2", "--log-every", "5",
                "--lr", "0.003", "--out", str(run), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [found] = server.runs("two-workers")  # the experiment: the run folder's parent
    client, run_id = server.client(), found.info.run_id
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["lr"] == "0.003" and found.data.params["devices"] == "2"
    assert found.data.tags["strategy"] == "ddp" and found.data.tags["devices"] == "2"
    assert found.data.tags["launcher"] == "spawn"  # summary.json's word: paratrain started the workers
    losses = client.get_metric_history(run_id, "loss")
    assert len(losses) >= 2 and [m.step for m in losses] == sorted(m.step for m in losses)
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == [20, 40]
    summary = json.loads((run / "summary.json").read_text())
    assert found.data.metrics["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert {a.path for a in client.list_artifacts(run_id)} >= {"summary.json", "config.yaml"}
    sent = json.loads(Path(client.download_artifacts(run_id, "summary.json", str(tmp_path))).read_text())
    assert sent["test_accuracy"] == summary["test_accuracy"] and sent["steps"] == 40

    proc = _cli(server.uri, "train", "--resume", str(run), "--epochs", "3", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [again] = server.runs("two-workers")  # the same MLflow run, carried on
    assert again.info.run_id == run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == [20, 40, 60]


@pytest.mark.integration
def test_a_stopped_run_is_killed_a_crashed_one_failed_and_a_resume_finishes_the_same_run(server: Server,
                                                                                      tmp_path: Path) -> None:
    """How a tracker run ends: SIGTERM to a 2-worker run (its checkpoint saved) leaves it KILLED, and --resume
    carries the same run on to FINISHED; an error in the user's network during training leaves it FAILED."""
    run = tmp_path / "ends" / "stopped"
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--logger", "mlflow", "--devices", "2",
                             "--epochs", "1000", "--log-every", "2", "--out", str(run), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: len(trackers.records(run)) >= 5, 240, "5 records")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err, err[-3000:]
    [stopped] = server.runs("ends")
    assert stopped.info.status == "KILLED", err[-3000:]
    logged = [m.step for m in server.client().get_metric_history(stopped.info.run_id, "loss")]
    assert len(logged) >= 4, logged
    proc = _cli(server.uri, "train", "--resume", str(run), "--epochs", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [resumed] = server.runs("ends")
    assert resumed.info.run_id == stopped.info.run_id and resumed.info.status == "FINISHED"
    assert max(m.step for m in server.client().get_metric_history(resumed.info.run_id, "loss")) > max(logged)

    crashed = tmp_path / "ends" / "crashed"
    model = crashing_model(tmp_path, "raise ValueError('a bug of mine at step 4')")
    proc = _cli(server.uri, "train", "--logger", "mlflow", "--model", model, "--devices", "2", "--steps", "50",
                "--log-every", "2", "--out", str(crashed), "--quiet")
    assert proc.returncode == 1 and "a bug of mine at step 4" in proc.stderr, proc.stderr[-3000:]
    ended = {r.info.run_name: r.info.status for r in server.runs("ends")}
    assert ended == {"stopped": "FINISHED", "crashed": "FAILED"}

    # rank 0 killed outright (SIGKILL, as the out-of-memory killer does): the launcher, which outlives it, ends its
    # tracker run FAILED (it stayed RUNNING until `paratrain log`)
    killed = tmp_path / "ends" / "killed"
    launcher = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--logger", "mlflow", "--devices", "2",
                                 "--epochs", "1000", "--log-every", "2", "--out", str(killed), "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: len(trackers.records(killed)) >= 3, 240, "3 records")
    os.kill(training_workers(launcher.pid)[0], signal.SIGKILL)
    _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 1 and "the run stopped" in err, err[-3000:]
    ended = {r.info.run_name: r.info.status for r in server.runs("ends")}
    assert ended["killed"] == "FAILED", err[-3000:]


@pytest.mark.integration
def test_a_password_in_the_tracking_uri_is_never_printed_nor_kept(server: Server, tmp_path: Path) -> None:
    uri = server.uri.replace("http://", "http://alice:s3cret-pw@")  # this server takes any credentials
    run = tmp_path / "secret" / "run"
    proc = _cli(uri, "train", "--logger", "mlflow,csv", "--steps", "10", "--log-every", "5", "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alice:***@127.0.0.1" in proc.stdout + proc.stderr and "s3cret" not in proc.stdout + proc.stderr
    assert not [p for p in run.rglob("*") if p.is_file() and b"s3cret" in p.read_bytes()]
    [found] = server.runs("secret")
    assert not [v for v in {**found.data.params, **found.data.tags}.values() if "s3cret" in v]


@pytest.mark.integration
def test_a_search_is_a_parent_run_with_a_child_run_per_trial(server: Server, tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("params:\n  lr: {low: 0.001, high: 0.01, log: true}\nfixed:\n  epochs: 1\n")
    out = tmp_path / "searches" / "lr-search"
    proc = _cli(server.uri, "search", "--space", str(space), "--trials", "4", "--parallel", "1", "--logger", "mlflow",
                "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = server.runs("searches")
    [parent] = [r for r in runs if r.info.run_name == "lr-search"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 5 and len(children) == 4
    assert all(c.data.tags["state"] == "finished" and 0 < c.data.metrics["objective"] <= 1 for c in children)
    for child in children:  # where each trial ran, as its summary.json says
        [summary] = [json.loads(p.read_text()) for p in out.rglob("summary.json")
                     if p.parent.name == child.info.run_name]
        assert (child.data.tags["devices"], child.data.tags["launcher"]) == (str(summary["world_size"]), "spawn")
    assert "strategy" not in parent.data.tags  # a search has none of its own
    assert sorted(float(c.data.params["lr"]) for c in children) == sorted(float(c.data.tags["param.lr"])
                                                                            for c in children)
    best = max(c.data.metrics["objective"] for c in children)
    assert parent.info.status == "FINISHED" and parent.data.metrics["best_objective"] == pytest.approx(best)
    assert "trials.csv" in {a.path for a in server.client().list_artifacts(parent.info.run_id)}


@pytest.mark.integration
def test_a_bench_is_a_parent_run_with_a_child_run_per_configuration(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "benches" / "cpu"
    proc = _cli(server.uri, "bench", "--configs", "cpu:1t,tower-cpu:2", "--steps", "10", "--repeats", "1",
                "--dataset", "digits", "--logger", "mlflow", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = server.runs("benches")
    [parent] = [r for r in runs if r.info.run_name == "cpu"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(runs) == 3 and set(children) == {"cpu:1t", "tower-cpu:2"}
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    for name, child in children.items():
        assert child.data.metrics["examples_per_sec"] == pytest.approx(rows[name]["examples_per_sec"]["mean"])
        assert child.data.tags["state"] == "ok" and child.data.params["steps"] == "10"
        assert child.data.tags["devices"] == ("1" if name == "cpu:1t" else "2")
    assert {"results.json", "report.md"} <= {a.path for a in server.client().list_artifacts(parent.info.run_id)}
    for name in children:  # the first repeat's records, each sent once (its runs logged to no tracker live)
        losses = sum("loss" in r for r in trackers.records(out / "runs" / f"{name.replace(':', '-')}-r0"))
        assert len(server.client().get_metric_history(children[name].info.run_id, "loss")) == losses >= 1


@pytest.mark.integration
def test_a_server_stopped_mid_run_is_one_warning_and_paratrain_log_sends_the_rest(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.start()
    run = tmp_path / "stopped" / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--logger", "mlflow", "--devices", "2",
                             "--epochs", "40", "--log-every", "2", "--out", str(run), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: len(trackers.records(run)) >= 10, 240, "10 records")
    server.stop()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--logger mlflow failed" in warnings[0] and "paratrain log" in warnings[0], err
    records = trackers.records(run)
    assert records[-1]["step"] == 40 * 20 and sum("epoch_time_s" in r for r in records) == 40
    assert (run / "summary.json").is_file()

    server.start()  # the same store: the run it began is there, short of the records after the stop
    [begun] = server.runs("stopped")
    have = len(server.client().get_metric_history(begun.info.run_id, "loss"))
    assert begun.info.status == "RUNNING" and have < sum("loss" in r for r in records)
    proc = _cli(server.uri, "log", str(run), "--logger", "mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [done] = server.runs("stopped")
    assert done.info.run_id == begun.info.run_id and done.info.status == "FINISHED"
    steps = [m.step for m in server.client().get_metric_history(done.info.run_id, "loss")]
    assert len(steps) == len(set(steps)) == sum("loss" in r for r in records)  # each once
    server.stop()


def _wandb_records(path: Path) -> Iterator:
    """The records of a W&B run file (its LevelDB-style log: 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""  # 7: the file's header (":W&B", magic, version)
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item: object) -> str:
    return item.key or "/".join(item.nested_key)  # W&B writes a key in one field or the other


@pytest.mark.integration
def test_wandb_offline_holds_the_same_content(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="the wandb package is not installed (pip install 'paratrain[wandb]')")
    run = tmp_path / "offline" / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--logger", "wandb", "--epochs", "2",
                           "--log-every", "5", "--lr", "0.003", "--out", str(run), "--quiet"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [file] = run.glob("wandb/offline-run-*/run-*.wandb")
    found = list(_wandb_records(file))
    [header] = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    assert header.project == "offline" and header.display_name == "run" and "strategy=ddp" in header.tags
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["lr"] == {"value": 0.003} or config["lr"] == 0.003
    history = [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in found
               if r.WhichOneof("record_type") == "history"]
    assert sum("loss" in h for h in history) >= 2 and [h["step"] for h in history if "val_accuracy" in h] == [20, 40]
    summary = json.loads((run / "summary.json").read_text())
    ends = [{_key(i): json.loads(i.value_json) for i in r.summary.update} for r in found
            if r.WhichOneof("record_type") == "summary"]
    assert any(e.get("test_accuracy") == pytest.approx(summary["test_accuracy"]) for e in ends)
    kept = json.loads(next(file.parent.glob("files/summary.json")).read_text())
    assert kept["test_accuracy"] == summary["test_accuracy"]
    assert json.loads((run / "trackers.json").read_text())["wandb"]["id"] == header.run_id


def test_logger_names_and_a_password_in_the_uri_are_one_line_errors(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    for flags, words in ((["--logger", "mlflw"], "did you mean 'mlflow'?"),
                         (["--logger", "csv,csv"], "names a logger twice"),
                         (["--mlflow-uri", "http://alice:s3cret@host:5000"], "MLFLOW_TRACKING_PASSWORD")):
        assert main_code(["train", "--out", str(tmp_path / "r"), *flags]) == 2
        err = capsys.readouterr().err
        assert words in err and "s3cret" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.integration  # `paratrain log` processes, each importing mlflow (3 s)
def test_csv_and_a_file_store_from_paratrain_log(digits_run: Path, tmp_path: Path) -> None:
    import mlflow

    run = tmp_path / "run"
    shutil.copytree(digits_run, run)
    store = f"sqlite:///{tmp_path / 'store.db'}"
    proc = run_cli("log", str(run), "--logger", "csv,mlflow", "--mlflow-uri", store, cwd=tmp_path)  # ./mlruns there
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (run / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + len(trackers.records(run)) and rows[0].startswith("step,")
    client = mlflow.MlflowClient(store)
    [found] = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    losses = sum("loss" in r for r in trackers.records(run))
    assert found.info.status == "FINISHED" and len(client.get_metric_history(found.info.run_id, "loss")) == losses >= 1
    assert json.loads((run / "trackers.json").read_text())["mlflow"] == {"run_id": found.info.run_id, "uri": store,
                                                                         "ended": "FINISHED"}
    again = run_cli("log", str(run), "--logger", "mlflow", cwd=tmp_path)  # the store: the one the run logged to
    assert again.returncode == 0 and "is already in mlflow" in again.stderr, again.stderr[-3000:]
    assert len(client.get_metric_history(found.info.run_id, "loss")) == losses  # nothing sent twice
    other = tmp_path / "other"
    shutil.copytree(digits_run, other)
    proc = run_cli("log", str(other), "--logger", "mlflow", "--mlflow-uri", store, "--experiment", "mine",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r.info.run_name for r in client.search_runs([client.get_experiment_by_name("mine").experiment_id])] \
        == ["other"]


@pytest.mark.integration  # `paratrain log` processes, each importing mlflow (3 s)
def test_paratrain_log_to_a_server_that_is_down_fails_in_one_line_and_loses_nothing(digits_run: Path,
                                                                                   tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(digits_run, run)
    down = f"http://127.0.0.1:{free_port()}"
    proc = run_cli("log", str(run), "--logger", "csv,mlflow", "--mlflow-uri", down, cwd=tmp_path)
    err = [line for line in proc.stderr.strip().splitlines() if "logging to" not in line]  # csv's line
    assert proc.returncode == 1 and len(err) == 1, proc.stderr[-3000:]  # no warning beside the error
    assert f"--logger mlflow failed (MlflowException: Connection refused at {down})" in err[0], err
    assert "run this command again once the tracker answers" in err[0]
    assert (run / "metrics.csv").is_file() and json.loads((run / "trackers.json").read_text())["mlflow"] == {}


def test_a_run_carried_on_elsewhere_logs_into_the_store_it_began_in(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's default store is the current folder's: trackers.json keeps the store a run logged to (a URI
    without a password), so a resume or `paratrain log` started in another folder finds the same MLflow run."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    ident = trackers.Identity("elsewhere", "run", {"lr": 0.1})
    first = trackers.Trackers(tmp_path, ["mlflow"], ident, print, uri="sqlite:///store.db")  # relative, as the docs'
    first.finish(None, "KILLED")
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    again = trackers.Trackers(tmp_path, ["mlflow"], ident, print)
    assert again.uri == f"sqlite:///{tmp_path / 'store.db'}"
    assert [t.run_id for t in again.live] == [first.kept["mlflow"]["run_id"]]
    again.finish(None)
    assert list((tmp_path / "other").iterdir()) == []  # no store of MLflow's default made here
    assert trackers.identity(tmp_path, {"strategy": None, "mesh": None}).tags == {}  # a search's: no 'None' tag


def test_an_unreachable_server_is_one_warning_and_the_figures_stay(tmp_path: Path) -> None:
    said: list[str] = []
    ident = trackers.Identity("e", "r", {"lr": 0.1})
    found = trackers.Trackers(tmp_path, ["mlflow"], ident, said.append, uri=f"http://bob:pw@127.0.0.1:{free_port()}")
    assert found.live == [] and len(said) == 1 and "--logger mlflow failed" in said[0] and "pw@" not in said[0]
    assert "(MlflowException: Connection refused at http://bob:***@127.0.0.1:" in said[0], said  # the socket's words


def test_paratrain_log_refuses_what_it_cannot_send_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "not-a-run").mkdir()
    for argv, words in ((["log", str(tmp_path / "not-a-run"), "--logger", "csv"], "no config.yaml there"),
                        (["log", str(tmp_path / "not-a-run"), "--logger", "tensorboard"], "as it trains"),
                        (["log", str(tmp_path / "not-a-run"), "--logger", "mlfow"], "did you mean 'mlflow'?")):
        assert main_code(argv) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
    assert list((tmp_path / "not-a-run").iterdir()) == []  # nothing written there


def test_mlflow_records_reach_the_server_in_batches_off_the_training_loop(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """MlflowTracker.log only queues: its thread sends a second's records in one request, and finish waits for
    them all. A failed request comes back as the next log's error, with the records the server never took
    counted as pending (where `paratrain log` takes the run up)."""
    monkeypatch.chdir(tmp_path)  # a SQLite store's artifacts go to ./mlruns: here, not into the checkout
    store = f"sqlite:///{tmp_path / 'store.db'}"
    tracker = trackers.MlflowTracker(store)
    tracker.open(trackers.Identity("batches", "run", {"lr": 0.1}), {})
    requests: list[int] = []
    send = tracker.client.log_batch
    tracker.client.log_batch = lambda run_id, metrics=(), **kw: (requests.append(len(metrics)),
                                                                  send(run_id, metrics=metrics, **kw))
    for step in range(1, 51):
        tracker.log(step, {"loss": 1.0 / step, "accuracy": step / 50})
    tracker.finish([], {"steps": 50}, "FINISHED", {"test_accuracy": 0.9})
    history = tracker.client.get_metric_history(tracker.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 51)) and tracker.pending() == 0
    assert sum(requests) == 101 and len(requests) < 10, requests  # 50 records of 2, then the final figure

    failing = trackers.MlflowTracker(store)
    failing.open(trackers.Identity("batches", "failing", {}), {})
    failing.client.log_batch = lambda *a, **kw: (_ for _ in ()).throw(ConnectionError("server gone"))
    failing.log(1, {"loss": 1.0})
    failing.sender.thread.join(timeout=30)
    with pytest.raises(ConnectionError, match="server gone"):
        failing.log(2, {"loss": 0.5})
    assert failing.pending() == 1


def test_a_run_taken_up_again_is_sent_only_the_figures_its_store_lacks(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that the server took as it stopped, its answer lost, counts as unsent: `paratrain log` (or the
    run carried on) sent its records again, and the run held 10 steps twice (seen in CI). Taken up again after
    a failure, a run is sent each figure from the step after the last its store holds; the end's figures are
    sent whatever the store holds at their step (a window's rate there is not the run's)."""
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'store.db'}"
    first = trackers.MlflowTracker(store)
    kept = first.open(trackers.Identity("again", "run", {}), {})
    for step in range(1, 6):
        first.log(step, {"loss": 1.0 / step})
    first.log(5, {"val_loss": 0.5, "examples_per_sec": 10.0})
    first.sender.close()  # every request answered; then the count of what it took is lost (the stop)
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": {**kept, "sent": 2}}))  # it failed at step 3
    [again] = trackers.Trackers(tmp_path, ["mlflow"], trackers.Identity("again", "run", {}), print, uri=store,
                                have=5).live
    for step in range(3, 9):
        again.log(step, {"loss": 1.0 / step, "val_loss": 0.4})
    again.finish([], {"steps": 5}, "FINISHED", {"test_loss": 0.3, "examples_per_sec": 20.0})
    history = {name: [(m.step, m.value) for m in again.client.get_metric_history(kept["run_id"], name)]
               for name in ("loss", "val_loss", "test_loss", "examples_per_sec")}
    assert {name: sorted(step for step, _ in steps) for name, steps in history.items()} == {
        "loss": list(range(1, 9)), "val_loss": [5, 6, 7, 8], "test_loss": [5], "examples_per_sec": [5, 5]}
    assert again.client.get_run(kept["run_id"]).data.metrics["examples_per_sec"] == 20.0  # the run's, at the end


def test_a_tracker_run_ends_with_every_figure_of_the_summary() -> None:
    """A language model's validation perplexity and bits per byte, its FLOPs, its times: every number of
    summary.json but its settings (the run's params), its clock, and what the records sent over the run."""
    summary = {"world_size": 4, "global_batch_size": 32, "steps": 6, "train_time_s": 0.79, "eval_time_s": 0.32,
               "examples_per_sec": 81.0, "test_loss": 4.57, "val_loss": 4.54, "final_lr": 0.002, "seed": 0,
               "ended_at": 1796105358.6, "tokens_per_sec": 2592.8, "flops_per_token": 741120.0,
               "val_perplexity": 93.8, "val_bits_per_byte": 6.55, "test_perplexity": 96.9, "test_bits_per_byte": 6.6,
               "mfu": None, "strategy": "tp", "stopped_by_time": False, "model_state_bytes": [{"total": 1}]}
    logged = ("step", "loss", "val_loss", "examples_per_sec", "tokens_per_sec", "perplexity")  # metrics.jsonl's
    assert trackers.end_figures(summary, logged) == {  # (a validation loss: its last epoch's record, sent already)
        k: float(v) for k, v in summary.items() if k in (
            "steps", "train_time_s", "eval_time_s", "examples_per_sec", "test_loss", "final_lr", "tokens_per_sec",
            "flops_per_token", "val_perplexity", "val_bits_per_byte", "test_perplexity", "test_bits_per_byte")}
