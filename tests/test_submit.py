"""`paratrain submit`: the batch script it writes, the mistakes it refuses before a job waits in the queue, and
what it hands sbatch (a stand-in sbatch on PATH records it). tests/test_slurm_cluster.py submits for real."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import main_code


def test_the_dry_run_prints_a_requeueable_script_of_one_srun(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main_code(["submit", "--dry-run", "--nodes", "2", "--gpus-per-node", "4", "--time", "4:00:00",
                      "--partition", "gpu", "--account", "lab", "train", "--epochs", "3", "--requeue-signal",
                      "USR2"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=4:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
                 "#SBATCH --signal=USR2@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 f"#SBATCH --output={tmp_path / 'slurm-%j.out'}", f"cd {tmp_path}",
                 f"srun --kill-on-bad-exit=1 {sys.executable} -m paratrain train --epochs 3 --requeue-signal USR2"):
        assert line in lines, out
    assert not any("cpus-per-task" in line for line in lines)
    assert f"the run folder: {tmp_path / 'runs' / 'lenet5-digits-job{JOBID}'}" in err


@pytest.mark.parametrize(("argv", "said"), [
    (["submit", "--dry-run"], "paratrain submit takes the command to run after its own flags"),
    (["submit", "--dry-run", "train"], "a job without GPUs needs --cpus-per-task C"),
    (["submit", "--dry-run", "--cpus-per-task", "4", "--nodes", "2", "train", "--devices", "3"],
     "train's --devices 3 but the job has 2 task(s) (--nodes 2 x --ntasks-per-node 1); leave out --devices"),
    (["submit", "--dry-run", "--gpus-per-node", "2", "--ntasks-per-node", "4", "train"],
     "--ntasks-per-node 4 is more than --gpus-per-node 2"),
    (["submit", "--dry-run", "--cpus-per-task", "4", "train", "--accelerator", "gpu"],
     "train's --accelerator gpu needs GPUs in the job: add --gpus-per-node G"),
    (["submit", "--dry-run", "--cpus-per-task", "0", "train"], "--cpus-per-task must be at least 1"),
    (["submit", "--dry-run", "--cpus-per-task", "4", "train", "--lr", "-1"], "--lr must be a positive number, not -1"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--array", "3", "search", "--space", "mlp-mnist", "--out", "s"],
     "the tasks of a job array share one study: give the search --storage postgresql://"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--nodes", "2", "search", "--space", "mlp-mnist", "--out", "s"],
     "a search runs its trials on one node"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--array", "2", "train"], "--array is for a search"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "plan"], "paratrain submit runs train or search, not 'plan'"),
    (["submit", "--cpus-per-task", "2", "train", "--epochs", "1", "--dry-run"],
     "--dry-run is paratrain submit's own: put it before train"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--signal-seconds", "70000", "train"],
     "--signal-seconds is at most 65535"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "search", "--space", "nosuch", "--out", "s"],
     "cannot read the space file nosuch"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "search", "--space", "mlp-mnist", "--sampler", "gentic",
      "--out", "s"], "unknown --sampler 'gentic'"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--array", "2", "search", "--space", "mlp-mnist", "--worker",
      "--storage", "postgresql://h/d", "--out", "s"], "leave out --worker: in a job array task 0 starts the study"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "search", "--space", "mlp-mnist", "--storage",
      "postgresql://me:secret@h/d", "--out", "s"], "--storage holds a password, which the job script would keep"),
    (["submit", "--dry-run", "--cpus-per-task", "2", "--array", "2", "search", "--space", "mlp-mnist", "--storage",
      "postgres://h/d", "--out", "s"], "write postgresql://"),
])
def test_mistakes_are_one_line_before_anything_is_queued(argv: list[str], said: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert main_code(argv) == 2
    out, err = capsys.readouterr()
    assert said in err and not out and len(err.strip().splitlines()) == 1, err


def test_a_train_flag_typo_is_refused_naming_train(capsys: pytest.CaptureFixture) -> None:
    assert main_code(["submit", "--dry-run", "--cpus-per-task", "4", "train", "--epoch", "3"]) == 2
    assert "unrecognized arguments: --epoch 3 (did you mean --epochs?)" in capsys.readouterr().err


def _stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_submitting_hands_the_script_to_sbatch_and_names_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _stand_in(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/args; cat > {tmp_path}/script; echo "4242;cluster"')
    assert main_code(["submit", "--cpus-per-task", "2", "train", "--dataset", "mnist"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "args").read_text() == "--parsable\n"
    assert (tmp_path / "script").read_text().startswith("#!/bin/bash\n")
    assert out.strip() == (f"paratrain: submitted job 4242: 1 worker(s); its run folder "
                           f"{tmp_path / 'runs' / 'lenet5-mnist-job4242'}; its output slurm-4242.out; "
                           "squeue -j 4242 shows it")


def test_sbatch_refusing_or_missing_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in(tmp_path, monkeypatch, 'echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1')
    assert main_code(["submit", "--cpus-per-task", "2", "--partition", "gpu", "train"]) == 2
    assert "paratrain: error: sbatch refused the job: sbatch: error: invalid partition specified: gpu" in \
        capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert main_code(["submit", "--cpus-per-task", "2", "train"]) == 2
    assert "sbatch is not on PATH: submit from a machine of the Slurm cluster" in capsys.readouterr().err


def test_a_search_array_starts_the_study_in_task_0_and_joins_it_from_the_others(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PARATRAIN_STORAGE", "postgresql://me@db/paratrain")
    assert main_code(["submit", "--dry-run", "--array", "4", "--cpus-per-task", "8", "search", "--space", "mlp-mnist",
                      "--sampler", "grid", "--out", "grid1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    search = (f"srun --kill-on-bad-exit=1 {sys.executable} -m paratrain search --space mlp-mnist --sampler grid "
              "--out grid1")
    for line in ("#SBATCH --array=0-3", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=8",
                 f"#SBATCH --output={tmp_path / 'slurm-%A_%a.out'}", "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK",
                 'if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then', f"  {search}", "else",
                 f'  {search} --worker --out grid1-task"$SLURM_ARRAY_TASK_ID"', "fi"):
        assert line in lines, out
    assert f"the search folder: {tmp_path / 'grid1'}" in err


def test_the_signal_of_a_config_file_is_the_one_slurm_sends(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("requeue_signal: USR2\n")
    assert main_code(["submit", "--dry-run", "--cpus-per-task", "2", "train", "--config", str(config)]) == 0
    assert "#SBATCH --signal=USR2@120" in capsys.readouterr().out.splitlines()


def test_a_config_files_folder_and_signal_are_checked_and_named(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    folder, bad = tmp_path / "o.yaml", tmp_path / "k.yaml"
    folder.write_text(f"out: {tmp_path / 'fixed'}\n")
    assert main_code(["submit", "--dry-run", "--cpus-per-task", "2", "train", "--config", str(folder)]) == 0
    assert f"the run folder: {tmp_path / 'fixed'}" in capsys.readouterr().err
    bad.write_text("requeue_signal: KILL\n")  # a signal that cannot be caught would checkpoint nothing
    assert main_code(["submit", "--dry-run", "--cpus-per-task", "2", "train", "--config", str(bad)]) == 2
    assert "unknown requeue_signal 'KILL'; choose one of: USR1, USR2, URG, HUP" in capsys.readouterr().err
