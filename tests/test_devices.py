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


def test_a_users_own_malloc_settings_are_left_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """paratrain tunes glibc's malloc in each worker (runtime/proc.tune_malloc) unless the user set it: their
    MALLOC_*_ variables or GLIBC_TUNABLES' glibc.malloc.* are never overridden (they were, before 2026-12-01, so
    MALLOC_MMAP_THRESHOLD_ changed nothing of a sharded worker's peak)."""
    import os

    from paratrain.runtime import proc

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, option: int, value: int) -> int:
            calls.append((option, value))
            return 1

    monkeypatch.setattr(proc.ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(proc.sys, "platform", "linux")
    for name in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # a tunable of another part of glibc
    proc.tune_malloc()
    assert len(calls) == 3 and proc.user_malloc() == ""
    for name, value, said in [("MALLOC_MMAP_THRESHOLD_", "262144", "MALLOC_MMAP_THRESHOLD_=262144"),
                              ("GLIBC_TUNABLES", "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1",
                               "glibc.malloc.trim_threshold=1")]:
        calls.clear()
        with monkeypatch.context() as m:
            m.setenv(name, value)
            proc.tune_malloc()
            proc.tune_malloc(memory_first=True)
            assert calls == [] and proc.user_malloc() == said
