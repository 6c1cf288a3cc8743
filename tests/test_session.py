"""The session that opens a run (src/paratrain/session.py), as `paratrain train`, `paratrain.fit` and a search
trial meet it: the run folder held by its lock for the run's life (a second run refused in one line, the folder
left as it was, a new folder removed again when the start fails), the refusal to start a fresh run on a used
folder (in flags on the command line, in TrainConfig's fields in Python), --overwrite and --resume, a torchrun
start that carries the run on, a search trial that `--resume` carries on, and the checkpoint read once per
worker (the launcher not at all)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import main_code, newest_state

import paratrain
from paratrain.checkpoint import run_folder as rundir
from paratrain.core.errors import UserError

QUICK = {"quiet": True, "tensorboard": False, "devices": "1"}
FLAGS = ("--quiet", "--no-tensorboard", "--devices", "1", "--steps", "4")


_main = main_code


def test_a_folder_held_by_a_run_is_refused_in_one_line_and_left_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main_code(["train", "--out", str(run), *FLAGS]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with rundir.held(run):  # another run, going on
        capsys.readouterr()
        code = main_code(["train", "--resume", str(run), "--steps", "8", "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--out {run} is in use by another run (process {os.getpid()}" in err[0]
    assert err[0].endswith("wait for it to end, or pass another --out")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # untouched
    assert main_code(["train", "--resume", str(run), "--steps", "8", "--quiet"]) == 0  # let go: it carries on


def test_a_start_refused_by_a_run_that_made_the_folder_at_once_leaves_that_run_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two starts both found the folder missing; the refused one removed the (still empty) folder on its way out,
    and the other run's lock was left on a deleted folder that a third run could not see."""
    run, real_open = tmp_path / "a" / "run", os.open
    other = rundir.held(run)

    def opened_once_the_other_holds_it(path: object, flags: int) -> int:
        monkeypatch.setattr(rundir.os, "open", real_open)
        other.__enter__()  # the other run takes the folder between this start's look and its lock
        return real_open(path, flags)

    monkeypatch.setattr(rundir.os, "open", opened_once_the_other_holds_it)
    try:
        with pytest.raises(UserError, match="is in use by another run"), rundir.held(run):
            pass
        assert run.is_dir()
        with pytest.raises(UserError, match="is in use by another run"), rundir.held(run):  # a third: refused
            pass
    finally:
        other.__exit__(None, None, None)


def test_a_start_that_made_the_folder_to_check_it_leaves_it_to_the_run_that_took_it_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two starts at once into a missing folder: one made it to check that it can write there (and puts it back
    as it found it), the other took it for its run in between. The check leaves the folder that run holds: it
    removed it, and then made and locked a new one, so both trained into one folder (seen once in CI)."""
    from paratrain.core import outputs

    run, real_mkstemp, other = tmp_path / "a" / "run", outputs.tempfile.mkstemp, rundir.held(tmp_path / "a" / "run")

    def probed_once_the_other_holds_it(**kwargs: object) -> tuple[int, str]:
        other.__enter__()
        return real_mkstemp(**kwargs)

    monkeypatch.setattr(outputs.tempfile, "mkstemp", probed_once_the_other_holds_it)
    try:
        outputs.check_writable(run)
        monkeypatch.undo()
        assert run.is_dir()
        with pytest.raises(UserError, match="is in use by another run"), rundir.held(run):
            pass
    finally:
        other.__exit__(None, None, None)
    outputs.check_writable(tmp_path / "b" / "c")  # held by none: put back as it was
    assert not (tmp_path / "b").exists()


def test_a_start_whose_folder_is_removed_as_it_locks_it_locks_the_folder_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, real_flock = tmp_path / "run", rundir.fcntl.flock

    def removed_first(fd: int, how: int) -> None:
        monkeypatch.setattr(rundir.fcntl, "flock", real_flock)
        run.rmdir()  # another start puts back the folder it made to check it
        real_flock(fd, how)

    monkeypatch.setattr(rundir.fcntl, "flock", removed_first)
    with rundir.held(run):
        assert run.is_dir()
        with pytest.raises(UserError, match="is in use by another run"), rundir.held(run):  # the one held
            pass


def test_a_folder_held_for_an_instant_by_another_commands_check_is_not_taken_for_a_run(tmp_path: Path) -> None:
    """Another command's check of --out locks the folder for an instant as it removes it (outputs.remove_made):
    a start in that instant waits for it rather than be refused as if a run held the folder."""
    import fcntl
    import threading

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.05, os.close, (fd,)).start()  # let go of it 50 ms on
    with rundir.held(run):
        assert run.is_dir()


def test_a_new_folder_is_removed_again_when_the_start_fails(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    assert main_code(["train", "--out", str(out), "--quiet", "--devices", "1", "--batch-size", "100000"]) == 2
    assert not (tmp_path / "a").exists()


def test_a_new_run_on_a_finished_one_is_refused_and_the_old_run_kept(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    run = tmp_path / "r2"
    assert _main(["train", "--quiet", "--no-tensorboard", "--devices", "1", "--steps", "5", "--checkpoint-every",
                  "5", "--out", str(run)]) == 0
    before = {p.name: p.read_bytes() for p in [run / "config.yaml", run / "summary.json"]}
    capsys.readouterr()
    assert _main(["train", "--quiet", "--devices", "1", "--steps", "3", "--lr", "0.01", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a finished run, checkpoints up to step 5" in err, err
    assert f"--resume {run}" in err and "--overwrite" in err, err
    assert {p.name: p.read_bytes() for p in [run / "config.yaml", run / "summary.json"]} == before


def test_overwrite_clears_the_old_run_first(tmp_path: Path) -> None:
    run = tmp_path / "r"
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, checkpoint_every=5, out=str(run), **QUICK))
    (run / "notes.txt").write_text("mine\n")  # a file of the user's: not the run's, so kept
    summary = paratrain.fit(None, "digits", paratrain.TrainConfig(steps=3, out=str(run), overwrite=True, **QUICK))
    assert summary["steps"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003"]
    assert "overwrite: false" in (run / "config.yaml").read_text()  # a resume of it will not clear it
    assert newest_state(run)["config"]["overwrite"] is False
    assert paratrain.evaluate(run)["step"] == 3
    assert (run / "notes.txt").read_text() == "mine\n"
    assert all(r["step"] <= 3 for r in map(__import__("json").loads, (run / "metrics.jsonl").read_text().splitlines()))


def test_resume_and_a_fresh_folder_still_work_and_overwrite_with_resume_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "r"
    (run / "unrelated").mkdir(parents=True)  # a folder with other things in it holds no run
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), **QUICK))
    summary = paratrain.fit(None, "digits", paratrain.TrainConfig(resume=str(run), steps=4, **QUICK))
    assert summary["steps"] == 4 and summary["resumed_from_step"] == 2
    with pytest.raises(UserError, match="drop one of them"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(resume=str(run), overwrite=True, **QUICK))


def test_a_run_without_checkpoint_is_not_offered_to_resume_and_torchrun_refuses_overwrite(tmp_path: Path,
                                                                                         monkeypatch) -> None:  # noqa: ANN001
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")  # a run killed before its first checkpoint
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-notes.pt").write_text("")  # and a stray file: no crash on its name
    with pytest.raises(UserError, match="holds an unfinished run; it has no checkpoint to carry on from: pass a new "
                                        "out or add overwrite=True"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), **QUICK))
    # a run that ended before its first step (a script without the __main__ guard) left nothing to keep
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "config.yaml").write_text("steps: 3\n")
    (empty / "parts.yaml").write_text("model: Old\n")
    paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(empty), **QUICK))
    assert not (empty / "parts.yaml").exists() and "steps: 2" in (empty / "config.yaml").read_text()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="every torchrun start \\(and restart\\) carries on the run in out"):
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=2, out=str(run), overwrite=True, **QUICK))
    assert (run / "config.yaml").read_text() == "steps: 3\n"


def test_a_python_run_into_a_used_folder_is_refused_in_fields(digits_run: Path) -> None:
    with pytest.raises(UserError) as e:
        paratrain.fit(None, "digits", paratrain.TrainConfig(steps=5, out=str(digits_run), **QUICK))
    message = str(e.value)
    assert f"TrainConfig(resume='{digits_run}')" in message and "add overwrite=True" in message, message
    assert "--" not in message, message


def test_the_command_line_keeps_its_flags(digits_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main_code(["train", "--quiet", "--devices", "1", "--steps", "5", "--out", str(digits_run)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {digits_run}" in err and "--overwrite" in err and "TrainConfig" not in err, err


def test_a_search_trial_is_a_run_that_resume_carries_on(tmp_path: Path) -> None:
    from paratrain import config
    from paratrain.data import load_dataset
    from paratrain.search.runner import train_one

    trial = tmp_path / "trials" / "0000"
    cfg = config.validate(config.TrainConfig(out=str(trial), steps=3, optimizer="sgd", momentum=0.9, lr=0.02,
                                             quiet=True, tensorboard=False))
    first = train_one(cfg, load_dataset("digits"), 0, 1, "cpu", 1)
    assert first["steps"] == 3 and (trial / "config.yaml").is_file()
    assert main_code(["train", "--resume", str(trial), "--steps", "6"]) == 0
    summary = json.loads((trial / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from_step"] == 3


AUDIT = '''
import os, sys
def _hook(event, args, log=os.environ["PARATRAIN_TEST_OPENS"]):
    # a checkpoint read: not the fsync of one being written (os.open, read-only, in its hidden folder)
    if event == "open" and isinstance(args[0], str) and "/checkpoints/" in args[0] and args[0].endswith(".pt") \\
            and (args[1] or "r").startswith("r") and "/.step-" not in args[0]:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {args[0]}\\n")
sys.addaudithook(_hook)
'''


def _opens(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess, Counter]:
    """Run `command` with every Python process of it logging the checkpoints it opens for reading (an audit
    hook in a sitecustomize: the launcher, the forkserver's workers, torchrun's ranks)."""
    hook, log = tmp_path / "hook", tmp_path / "opens.log"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(AUDIT)
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
           "PARATRAIN_TEST_OPENS": str(log)}
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, env=env)
    return proc, Counter(log.read_text().split("\n")[:-1])


@pytest.mark.integration
def test_resuming_a_2_worker_run_reads_its_checkpoint_once_in_each_worker_and_never_in_the_launcher(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("--quiet", "--no-tensorboard", "--devices", "2", "--optimizer", "sgd", "--momentum", "0.9", "--lr",
            "0.02", "--checkpoint-every", "5")
    proc, _ = _opens(tmp_path, "-m", "paratrain", "train", "--out", str(run), "--steps", "10", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, opens = _opens(tmp_path, "-m", "paratrain", "train", "--resume", str(run), "--steps", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = Counter(line.split()[0] for line in opens)
    assert len(pids) == 2 and all(n == 1 for n in opens.values()), opens  # two workers, one read each
    assert all(line.endswith("step-00000010/meta.pt") for line in opens), opens
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 10


@pytest.mark.integration
def test_a_torchrun_start_reads_the_checkpoint_once_per_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "paratrain", "train",
            "--out", str(run), "--quiet", "--no-tensorboard", "--optimizer", "sgd", "--momentum", "0.9",
            "--checkpoint-every", "5")
    proc, _ = _opens(tmp_path, *args, "--steps", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = time.time()
    proc, opens = _opens(tmp_path, *args, "--steps", "15")  # a later start carries the run on
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len({line.split()[0] for line in opens}) == 2 and all(n == 1 for n in opens.values()), opens
    assert "carrying on from the checkpoint of step 10" in proc.stderr
    assert newest_state(run)["step"] == 15
    assert time.time() - started < 300


@pytest.mark.integration
def test_two_runs_started_at_once_into_one_folder_one_trains_the_other_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "paratrain", "train", "--out", str(run), "--quiet", "--no-tensorboard",
               "--devices", "2", "--steps", "40", "--log-every", "1"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], done
    refused = next(err for p, (_, err) in zip(procs, done, strict=True) if p.returncode == 2)
    lines = [line for line in refused.splitlines() if line.startswith("paratrain")]
    assert len(lines) == 1 and f"--out {run} is in use by another run (process " in lines[0], refused
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 41)), steps  # one run's log, whole


def test_a_resumed_run_shows_progress_though_it_ran_quiet(tmp_path: Path) -> None:
    """A search trial runs quiet, and config.yaml records it; `paratrain train --resume TRIAL` is a command of
    its own and shows its progress (how a command shows it is not the run's to keep)."""
    from paratrain import config as C

    C.save_yaml(C.TrainConfig(dataset="digits", quiet=True, devices="1"), tmp_path / "config.yaml")
    assert C.load_yaml(tmp_path / "config.yaml")["quiet"] is True
    carried = C.of_run(tmp_path, f"--resume {tmp_path}")
    assert carried.quiet is False and carried.devices == "1"
