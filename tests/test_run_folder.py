"""The run folder (src/paratrain/checkpoint/run_folder.py), alone: its checkpoints listed by step, the check
that keeps a fresh run off another, --overwrite's clearing of only a run's files, and the lock a run holds for
its life."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from paratrain.checkpoint import run_folder
from paratrain.core.errors import UserError


def _touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_step_checkpoints_are_files_or_folders_by_step_and_nothing_else(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    _touch(folder / "step-00000010.pt")
    (folder / "step-00000002").mkdir()  # a sharded strategy's step folder
    _touch(folder / "last.pt")
    _touch(folder / "step-00000005")  # a file without .pt: not a checkpoint
    (folder / "step-00000007.pt").mkdir()  # a folder named as a file: not a checkpoint
    _touch(folder / "step-abc.pt")
    assert [(s, p.name) for s, p in run_folder.step_checkpoints(folder)] == [(2, "step-00000002"),
                                                                             (10, "step-00000010.pt")]
    assert run_folder.newest_step(tmp_path) == 10
    assert run_folder.step_checkpoints(tmp_path / "missing") == [] and run_folder.newest_step(tmp_path / "x") is None


def test_a_fresh_start_is_refused_on_a_run_and_says_how_to_go_on(tmp_path: Path) -> None:
    run_folder.check_fresh(tmp_path / "new", overwrite=False)  # nothing there
    _touch(tmp_path / "new" / "config.yaml")  # a start that took no step leaves only its record: not a run
    run_folder.check_fresh(tmp_path / "new", overwrite=False)
    run = tmp_path / "run"
    _touch(run / "checkpoints" / "step-00000004.pt")
    with pytest.raises(UserError, match=r"holds an unfinished run, checkpoints up to step 4; carry it on with "
                                        r"--resume .* or add --overwrite"):
        run_folder.check_fresh(run, overwrite=False)
    run_folder.check_fresh(run, overwrite=True)
    _touch(run / "checkpoints" / run_folder.WEIGHTS_ONLY)  # a search trial's kept weights: not to be carried on
    _touch(run / "summary.json", "{}")
    with pytest.raises(UserError, match="holds a finished run, .* it has no checkpoint to carry on from"):
        run_folder.check_fresh(run, overwrite=False)
    assert "kept only its weights" in run_folder.weights_only(run)


def test_overwrite_clears_only_what_a_run_writes(tmp_path: Path) -> None:
    for name in ("config.yaml", "summary.json", "metrics.jsonl", "checkpoints/step-00000001.pt", "tb/events",
                 "mine.txt", "data-cache/images.npy"):
        _touch(tmp_path / name)
    run_folder.clear_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data-cache", "mine.txt"]


def test_a_held_folder_is_refused_to_a_second_holder_and_let_go_after(tmp_path: Path) -> None:
    run = tmp_path / "a" / "run"
    with run_folder.held(run):
        assert run.is_dir()
        with pytest.raises(UserError, match=r"is in use by another run \(process \d+") as refused:
            with run_folder.held(run):  # a second open file description: flock refuses it as another process's
                pass
        assert refused.value.code == 2 and run.is_dir()  # refused, and nothing removed
    with run_folder.held(run):  # let go at the end of the first
        pass


def test_a_failed_start_removes_the_folders_it_made_and_only_those(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with run_folder.held(tmp_path / "kept" / "new" / "run"):
            raise RuntimeError("bad input found after the lock")
    assert not (tmp_path / "kept" / "new").exists() and (tmp_path / "kept").is_dir()
    _touch(tmp_path / "busy" / "config.yaml")
    with pytest.raises(RuntimeError):
        with run_folder.held(tmp_path / "busy"):
            raise RuntimeError("a folder that was there stays")
    assert (tmp_path / "busy" / "config.yaml").is_file()


def test_after_a_failed_write_the_newest_checkpoint_is_named(tmp_path: Path) -> None:
    assert "no checkpoint was kept" in run_folder.kept_after_failure(tmp_path, "free some space")
    _touch(tmp_path / "checkpoints" / "step-00000003.pt")
    said = run_folder.kept_after_failure(tmp_path, "free some space")
    assert "step-00000003.pt (step 3)" in said and f"--resume {tmp_path}" in said
    assert os.path.exists(tmp_path / "checkpoints" / "step-00000003.pt")
