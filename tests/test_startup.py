"""Where a run's time goes before its first step and after its last (summary.json), and the forkserver that
workers start from: as fresh as a spawned worker (the launcher's environment and streams at the launch)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import alive, descendants, main_code, run_cli, training_workers

import paratrain
from paratrain.checkpoint import files as checkpoint
from paratrain.parallel import strategies
from paratrain.runtime import clock, prefork

# its integration tests bound wall times or compare measured rates: .ci/run runs them with nothing beside
pytestmark = pytest.mark.alone

STARTUP = {"imports", "data", "plan", "spawn", "join", "build", "first_step"}


def test_one_workers_summary_says_where_the_start_up_went(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_code(["train", "--devices", "1", "--steps", "3", "--quiet", "--time-phases", "--no-tensorboard",
                      "--out", str(tmp_path / "run")]) == 0
    table = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    startup, finish = summary["startup_s"], summary["finish_s"]
    assert set(startup) == STARTUP and set(finish) == set(clock.FINISH)
    assert all(v is not None and v >= 0 for v in (*startup.values(), *finish.values()))
    assert startup["spawn"] < 0.05 and startup["join"] < 0.05  # one worker: in this process, no group
    assert summary["first_step_at_s"] >= startup["data"] + startup["build"]
    for phase in (*STARTUP, *clock.FINISH):
        assert f"\n{phase:<12} " in table
    assert "the first step started" in table


def test_process_start_is_before_now_and_after_boot() -> None:
    import time

    started = clock.process_start()
    assert 0 < time.time() - started < 24 * 3600 * 365  # this test process started in the past
    assert clock.startup({"process_start": 1.0, "train_called": 3.0, "data_s": 0.5, "launched": 4.0}) == {
        "imports": 2.0, "data": 0.5, "plan": 0.5, "spawn": None, "join": None, "build": None, "first_step": None}


def test_the_forkserver_starts_only_once_the_plan_knows_workers_will_be_forked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is started on a guess: one worker (what --devices auto plans on until it has measured), the
    tower's one process, and a rank of torchrun's start no forkserver; a plan of two workers does, before its
    data is read."""
    from paratrain import config
    from paratrain.data import load_dataset
    from paratrain.parallel import runplan
    from paratrain.runtime.devices import Hardware
    from paratrain.runtime.env import detect

    events: list[str] = []
    monkeypatch.setattr(prefork, "warm_up", lambda shield=None, model="": events.append("warm_up"))
    digits = load_dataset("digits", None)

    def plan(workers: int, **more: object) -> list[str]:
        events.clear()
        cfg = config.validate(config.TrainConfig(model="mlp", dataset="digits", steps=2, out="unused", **more))
        cfg = strategies.checked(cfg)
        runplan.make(cfg, lambda: events.append("data") or digits, hardware=Hardware("cpu", workers, 1, "gloo"))
        return list(events)

    assert plan(1) == ["data"]
    assert plan(2) == ["warm_up", "data"]
    # what the command line starts before it imports torch: only where the flags make it certain
    one = {name: strategies.get(name).one_process for name in ("ddp", "pipeline", "tower")}
    assert prefork.forks_for("2", one["ddp"], in_group=False)
    assert prefork.forks_for("4", one["pipeline"], in_group=False)
    assert not prefork.forks_for("auto", one["ddp"], in_group=False)  # auto decides in the plan, after measuring
    assert not prefork.forks_for("1", one["ddp"], in_group=False)
    assert not prefork.forks_for("2", one["tower"], in_group=False)  # one process drives the tower's devices
    assert not prefork.forks_for("2", one["ddp"], in_group=True)  # torchrun's rank: torchrun started the workers
    monkeypatch.setenv("PARATRAIN_START_METHOD", "spawn")
    assert prefork.start_method() == "spawn"
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    events.clear()
    cfg = config.validate(config.TrainConfig(model="mlp", dataset="digits", steps=2, out="unused"))
    cfg = strategies.checked(cfg)
    runplan.make(cfg, lambda: events.append("data") or digits, env=detect())  # torchrun started this worker
    assert events == ["data"]


@pytest.mark.integration
def test_the_main_job_on_two_workers_reports_every_phase_and_ends_without_a_warning(tmp_path: Path) -> None:
    proc = run_cli("train", "--steps", "20", "--devices", "2", "--out", str(tmp_path / "run"), "--time-phases",
                   fresh=True)  # a command's whole start, its imports too
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr  # nothing at exit
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert all(summary["startup_s"][p] is not None for p in STARTUP)
    assert summary["finish_s"]["shutdown"] is not None and summary["startup_s"]["spawn"] > 0
    assert "the first step started" in proc.stdout
    assert "step 20/20" in proc.stdout  # rank 0's line: a forked worker writes to the launcher's output


@pytest.mark.integration
def test_spawned_workers_as_before_write_their_lines(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--steps", "10", "--log-every", "5",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PARATRAIN_START_METHOD": "spawn"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 10/10" in proc.stdout and "Traceback" not in proc.stderr


def _start(run: Path, **popen: object) -> subprocess.Popen:
    launcher = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--devices", "2", "--epochs", "1000",
                                 "--log-every", "5", "--checkpoint-every", "5", "--out", str(run)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        time.sleep(0.2)
    assert len(training_workers(launcher.pid)) == 2, "training never started"
    return launcher


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_the_forkserver_imports_the_libraries_a_model_file_imports_and_runs_none_of_it(tmp_path: Path) -> None:
    """A model file that imports transformers (anywhere in it): the forkserver imports transformers' modeling
    base for the workers (each spent ~1.6 CPU-s on it), the file read, never run; a registry model, a file
    that imports no such library (a module of its own named so), one that cannot be read: torch's alone."""
    hf = tmp_path / "hf.py"
    hf.write_text("raise SystemExit('the file ran')\n\n\ndef build():\n    from transformers.models import llama\n")
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nfrom . import transformers\n")
    assert prefork.preload(f"{hf}:build") == [*prefork.PRELOAD, "paratrain.runtime._preload_transformers"]
    for model in ("gpt", f"{plain}:build", f"{tmp_path / 'missing.py'}:build", ""):
        assert prefork.preload(model) == prefork.PRELOAD, model
    # paratrain.fit given the function that builds it: the file the function is in (as a script's is)
    import runpy

    from paratrain.components.parts import Parts
    from paratrain.parallel.runplan import network_file

    script = tmp_path / "script.py"
    script.write_text("from transformers import GPT2LMHeadModel\n\n\ndef make_gpt2():\n    pass\n")
    given = runpy.run_path(str(script))["make_gpt2"]
    cfg = paratrain.TrainConfig()
    assert prefork.preload(network_file(cfg, Parts(model=given))) == prefork.preload(f"{hf}:build")
    assert prefork.preload(network_file(cfg, Parts(model=lambda: None))) == prefork.PRELOAD


def test_what_the_forkserver_imports_for_a_model_file_asks_for_no_gpu() -> None:
    """A process that asked CUDA for its devices before it forked gives its forked workers no GPU: importing
    the libraries' parts of prefork.LIBRARIES (in a fresh interpreter, as the forkserver does) asks for none,
    and does import the library's part."""
    for library, part in prefork.LIBRARIES.items():
        pytest.importorskip(library)
        code = ("import torch, torch.cuda\n"
                "asked = []\n"
                "for owner, name in ((torch._C, '_cuda_getDeviceCount'), (torch.cuda, 'is_available'),\n"
                "                    (torch.cuda, 'device_count'), (torch.cuda, '_lazy_init')):\n"
                "    def spy(*a, _f=getattr(owner, name), _n=name, **k):\n"
                "        asked.append(_n)\n"
                "        return _f(*a, **k)\n"
                "    setattr(owner, name, spy)\n"
                f"import {part}\n"
                "import sys\n"
                "print(asked, sorted(m for m in sys.modules if m.endswith('.modeling_utils')))\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == f"[] ['{library}.modeling_utils']", (part, done.stdout)


def test_the_forkserver_leaves_once_its_exit_handlers_ran_and_a_child_of_it_does_not() -> None:
    """The forkserver holds the launcher's standard streams until it exits, so a caller reading the command's
    output waited for it to tear torch down (1.5 s). It leaves by os._exit after its exit handlers, without
    finalization (the object below is never collected); a process forked from it that runs its exit handlers
    goes on."""
    code = ("import atexit, os, sys\n"
            "import paratrain.runtime._in_forkserver\n"
            "class Late:\n"
            "    def __del__(self): print('finalized', flush=True)\n"
            "kept = Late()\n"
            "atexit.register(print, 'exit handlers ran', flush=True)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    atexit._run_exitfuncs()\n"
            "    print('the child went on', flush=True)\n"
            "    os._exit(3)\n"
            "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3\n"
            "raise SystemExit\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["exit handlers ran", "the child went on", "exit handlers ran"]


@pytest.mark.integration
def test_a_launcher_killed_outright_takes_its_forkserver_and_workers_with_it(tmp_path: Path) -> None:
    launcher = _start(tmp_path / "run")
    others = descendants(launcher.pid)  # the forkserver, the workers, the resource tracker
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert _gone_within(others, 10) == []


@pytest.mark.integration
def test_sigterm_to_the_whole_process_group_saves_at_the_step(tmp_path: Path) -> None:
    """timeout, systemd and schedulers signal every process of the group, the forkserver included."""
    launcher = _start(tmp_path / "run", start_new_session=True)
    everyone = [launcher.pid, *descendants(launcher.pid)]
    os.killpg(launcher.pid, signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 143, stderr
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", stderr)
    assert stopped, stderr
    assert checkpoint.load(tmp_path / "run")["step"] == int(stopped.group(1))  # saved at the stop step
    assert _gone_within(everyone, 10) == []


def deep(channels: int, image_size: int, num_classes: int) -> object:
    """A network of 100 parameter tensors: with Adam's state, more than 256 tensors in its checkpoint."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size**2, 16),
                         *(nn.Linear(16, 16) for _ in range(48)), nn.Linear(16, num_classes))


@pytest.mark.integration
def test_a_deep_network_with_adams_state_resumes_on_two_workers(tmp_path: Path) -> None:
    """The forkserver passes at most 256 file descriptors with a worker's arguments: the checkpoint goes packed."""
    cfg = dict(devices="2", batch_size=32, tensorboard=False, quiet=True, optimizer="adam")
    paratrain.fit(deep, "digits", paratrain.TrainConfig(steps=2, out=str(tmp_path / "run"), **cfg))
    summary = paratrain.fit(deep, "digits", paratrain.TrainConfig(steps=4, resume=str(tmp_path / "run"), **cfg))
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4


def needs_the_variable(channels: int, image_size: int, num_classes: int) -> object:
    """A network factory that fails unless the launcher's environment at the launch reached the worker."""
    from torch import nn

    if os.environ.get("PARATRAIN_TEST_SET_AFTER_THE_FORKSERVER") != "yes":
        raise RuntimeError("the worker did not get the launcher's environment")
    if multiprocessing.parent_process() is not None:  # in a worker (the launcher tries the factory too)
        print(f"a worker built its network: {os.getpid()}", flush=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size**2, num_classes))


@pytest.mark.integration
def test_workers_see_the_environment_of_the_launch_not_of_the_forkservers_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    prefork.warm_up()  # started before the variable is set (as by an earlier run in this process)
    monkeypatch.setenv("PARATRAIN_TEST_SET_AFTER_THE_FORKSERVER", "yes")
    summary = paratrain.fit(needs_the_variable, "digits", paratrain.TrainConfig(
        devices="2", steps=2, batch_size=32, out=str(tmp_path / "run"), tensorboard=False))
    assert summary["world_size"] == 2
    # written by the workers to the launcher's standard output as pytest captures it now
    assert capfd.readouterr().out.count("a worker built its network") == 2
