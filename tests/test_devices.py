import json

import pytest

from paratrain.cli import main
from paratrain.core.errors import UserError
from paratrain.runtime import devices


def test_devices_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["devices", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cpu"]["cores"] == devices.usable_cores() >= 1
    assert info["gpus"] == [] and info["backend"] == "gloo"  # conftest hides any GPU from this test
    assert info["auto_devices"] * info["threads_per_worker"] <= info["cpu"]["cores"]  # never more threads than cores


def test_devices_text(capsys: pytest.CaptureFixture) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "--devices auto =" in out


def test_cpu_plan_never_oversubscribes() -> None:
    cores = devices.usable_cores()
    plan = devices.resolve("cpu", "auto", None)
    assert plan.backend == "gloo" and plan.workers * plan.threads_per_worker <= cores
    assert devices.resolve("cpu", "1", None).threads_per_worker == cores
    with pytest.raises(UserError, match="more CPU workers than"):
        devices.resolve("cpu", str(cores + 1), None)


def test_gpu_asked_without_gpu() -> None:
    with pytest.raises(UserError, match="no CUDA GPU"):
        devices.resolve("gpu", "auto", None)
