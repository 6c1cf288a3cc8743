"""The optional dependencies (pyproject's extras): without one, what needs it says in one line what to install,
and everything else works as before (the README's first command above all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import main_code

import paratrain
from paratrain.core import optional as extras

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("optuna", "matplotlib", "tensorboard", "sklearn", "scipy", "psycopg")


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """without(*modules): those modules count as not installed (extras.installed says no)."""
    def hide(*modules: str) -> None:
        real = extras.find_spec
        monkeypatch.setattr(extras, "find_spec", lambda name, *a: None if name in modules else real(name, *a))

    return hide


def test_the_core_dependencies_leave_out_what_only_some_users_need() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("scikit-learn", "scipy", "optuna", "matplotlib", "tensorboard", "psycopg", "tiktoken", "tokenizers",
                 "transformers"):
        assert name not in core, name
    extra = project["optional-dependencies"]
    assert {"search", "plots", "tensorboard", "postgres", "text", "transformers", "all"} <= set(extra)
    assert extra["all"] == ["paratrain[search,plots,tensorboard,postgres,text]"]  # transformers: a model of yours


def test_a_search_without_optuna_says_what_to_install(tmp_path: Path, without, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    without("optuna")
    assert main_code(["search", "--space", "mlp-mnist", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("paratrain: error: paratrain search needs optuna, which is not installed: pip install "
                   "'paratrain[search]' (or 'paratrain[all]')"), err
    assert not (tmp_path / "s").exists()


def test_a_run_without_tensorboard_writes_every_figure_but_the_event_files(tmp_path: Path, without,  # noqa: ANN001
                                                                          capsys: pytest.CaptureFixture) -> None:
    without("tensorboard")
    paratrain.fit(None, "digits", paratrain.TrainConfig(out=str(tmp_path / "run"), steps=4, devices="1"))
    out = capsys.readouterr().out
    assert "no TensorBoard event files: the tensorboard package is not installed (pip install " \
           "'paratrain[tensorboard]'" in out
    assert not (tmp_path / "run" / "tb").exists() and (tmp_path / "run" / "metrics.jsonl").stat().st_size


def test_a_report_without_matplotlib_is_its_tables(tmp_path: Path, without) -> None:  # noqa: ANN001
    from paratrain.measure import bench, plot

    assert main_code(["train", "--steps", "4", "--devices", "1", "--out", str(tmp_path / "run"), "--quiet",
                      "--no-tensorboard"]) == 0
    without("matplotlib")
    text = plot.write_report({"context": bench.context(), "results": [bench.result_from_run(tmp_path / "run")]},
                             tmp_path, rates="summary").read_text()
    assert "| run | 1 |" in text and "No plots: matplotlib is not installed (pip install 'paratrain[plots]'" in text
    assert not list(tmp_path.glob("*.png")) and "![" not in text


# sitecustomize.py, which every Python process started with it on PYTHONPATH runs first (the workers and their
# forkserver too): none of the optional packages can be imported, nor found
BLOCKER = """
import importlib.abc, importlib.util, sys
OPTIONAL = {optional!r}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, Missing())
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in OPTIONAL else real(name, *a)
"""


@pytest.mark.integration
def test_the_first_command_works_without_any_extra(tmp_path: Path) -> None:
    """`paratrain train` on 2 workers, and `--help`, where none of the optional packages can be imported."""
    import os

    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER.format(optional=set(OPTIONAL)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), os.environ.get("PYTHONPATH", "")])}
    assert subprocess.run([sys.executable, "-c", "import optuna"], env=env, capture_output=True).returncode == 1
    for argv in (["train", "--steps", "20", "--devices", "2", "--out", str(tmp_path / "run")],):
        proc = subprocess.run([sys.executable, "-m", "paratrain", *argv], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5 and "no TensorBoard event files" in proc.stdout


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_tracker_without_its_client_says_what_to_install(tmp_path: Path, without, tracker: str,  # noqa: ANN001
                                                           capsys: pytest.CaptureFixture) -> None:
    without(tracker)
    assert main_code(["train", "--logger", f"csv,{tracker}", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"paratrain: error: --logger {tracker} needs {tracker}, which is not installed: pip install "
                   f"'paratrain[{tracker}]'"), err
    assert not (tmp_path / "r").exists()
