"""Where a run's processes and tensors go on GPUs, checked on a faked inventory (conftest.FakeGPUs) on every
machine: no GPU has been lent to this project, so these decisions are tested before the first one is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import FakeGPUs

from paratrain import config
from paratrain.core.errors import UserError
from paratrain.data import load_dataset
from paratrain.parallel import runplan, strategies
from paratrain.runtime import devices


@pytest.mark.parametrize("count", [1, 2, 8])
def test_devices_auto_takes_every_gpu_with_nccl(fake_gpus: FakeGPUs, count: int) -> None:
    fake_gpus(count)
    plan = devices.resolve("auto", "auto", None)
    assert (plan.accelerator, plan.workers, plan.backend) == ("gpu", count, "nccl")
    assert plan.workers * plan.threads_per_worker <= max(devices.usable_cores(), count)  # cores shared, not more
    assert runplan.device_map(plan) == tuple(f"cuda:{i}" for i in range(count))


def test_cpus_get_gloo_and_more_gpus_than_exist_is_one_line(fake_gpus: FakeGPUs) -> None:
    fake_gpus(2)
    assert devices.resolve("cpu", "1", None).backend == "gloo"
    with pytest.raises(UserError) as e:
        devices.resolve("auto", "3", None)
    assert str(e.value) == "--devices 3 asks for more GPUs than the 2 here; use --devices 2 or fewer"
    fake_gpus(0)
    with pytest.raises(UserError, match="no CUDA GPU is visible; use --accelerator cpu"):
        devices.resolve("gpu", "auto", None)


def _plan(**kw: object) -> runplan.RunPlan:
    cfg = config.validate(config.TrainConfig(model="mlp", dataset="digits", steps=2, **kw))
    return runplan.make(strategies.checked(cfg), lambda: load_dataset("digits"))


@pytest.mark.parametrize(("param_device", "process_device"), [("cpu", "cpu"), ("cuda:0", "cuda:0")])
def test_the_tower_drives_every_gpu_from_one_process(fake_gpus: FakeGPUs, param_device: str,
                                                     process_device: str) -> None:
    fake_gpus(4)
    plan = _plan(strategy="tower", param_device=param_device)
    assert plan.hardware.workers == 1 and plan.devices == (process_device,)
    assert plan.layout.replicas == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert plan.cfg.devices == "4" and plan.cfg.accelerator == "gpu"
    # summary.json's devices, whose peaks the MFU adds up: the 4 GPUs (it counted one GPU's peak for 4)
    from paratrain.parallel.launch import describe_devices

    assert [d.split(" ")[0] for d in describe_devices(plan)] == list(plan.layout.replicas)


def test_pipeline_stages_and_hybrid_copies_each_get_their_own_gpu(fake_gpus: FakeGPUs) -> None:
    fake_gpus(8)
    pipe = _plan(strategy="pipeline", stages=2, devices="2", batch_size=32)
    assert pipe.devices == ("cuda:0", "cuda:1") and pipe.hardware.backend == "nccl"
    hybrid = _plan(strategy="hybrid", stages=2, devices="8", batch_size=32)
    assert hybrid.devices == tuple(f"cuda:{i}" for i in range(8)) and hybrid.hardware.workers == 8
    ddp = _plan(devices="auto")
    assert ddp.devices == tuple(f"cuda:{i}" for i in range(8))


def test_a_gpu_worker_joins_nccl_and_a_cpu_worker_gloo(fake_gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.runtime import dist

    fake_gpus(2)
    joined = []
    monkeypatch.setattr(dist.dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw)))
    monkeypatch.setattr(dist, "loopback_store", lambda *a: "store")
    assert dist.init(1, 2, "cuda:1", 29500).backend == "nccl"
    assert joined[-1][1]["device_id"] == torch.device("cuda:1")  # NCCL binds the worker's own GPU
    assert dist.init(1, 2, "cpu", 29500).backend == "gloo" and joined[-1][1]["device_id"] is None


def test_the_doctors_inventory_lists_the_gpus_and_their_peers(fake_gpus: FakeGPUs) -> None:
    from paratrain.measure.doctor.inventory import described, inventory

    fake_gpus(2, name="NVIDIA A100-SXM4-80GB")
    info = inventory()
    assert [g["name"] for g in info["gpus"]] == ["NVIDIA A100-SXM4-80GB"] * 2
    assert info["peer_access"] == [[0, 1], [1, 0]] and info["auto_devices"] == 2 and info["backend"] == "nccl"
    lines = "\n".join(described(info))
    assert "GPU 1: NVIDIA A100-SXM4-80GB, 80.0 GiB, compute capability 9.0" in lines
    assert "peer access: 2 of 2 GPU pairs" in lines


@pytest.mark.parametrize(("asked", "ran", "said"), [("16-mixed", "bf16", "this run uses bf16"),
                                                    ("tf32", "32", "this run computes in float32")])
def test_a_gpu_precision_on_the_cpu_runs_what_the_cpu_has_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                     asked: str, ran: str, said: str) -> None:
    """--precision 16-mixed where there is no GPU: float16 has no fast CPU kernels (a ResNet-18 ran 86x slower),
    so the run uses bf16; tf32 is a GPU's format, so the run is float32. Each says so in one note, and records
    what ran."""
    from paratrain import fit

    cfg = config.TrainConfig(model="mlp", dataset="digits", steps=5, precision=asked, quiet=True,
                             tensorboard=False, devices="1", out=str(tmp_path / "run"))
    summary = fit(None, None, cfg)
    assert summary["steps"] == 5 and summary["val_loss"] == summary["val_loss"] and summary["val_loss"] < 10
    assert summary["precision"] == ran
    assert str(config.load_yaml(tmp_path / "run" / "config.yaml")["precision"]) == ran
    notes = [line for line in capsys.readouterr().err.splitlines() if asked in line]
    assert len(notes) == 1 and said in notes[0]


def test_precisions_the_devices_lack(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a GPU without it is refused in one line; on a CPU without bfloat16 instructions it runs, noted."""
    from paratrain.runtime import devices

    gpu = devices.Hardware("gpu", 1, 1, "nccl")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla T4")
    with pytest.raises(UserError, match="Tesla T4 has no bfloat16 support; use --precision 16-mixed or 32"):
        devices.precision_on("bf16", gpu)
    assert devices.precision_on("16-mixed", gpu) == ("16-mixed", None)
    cpu = devices.Hardware("cpu", 1, 2, "gloo")
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    precision, note = devices.precision_on("bf16", cpu)
    assert precision == "bf16" and note is not None and "emulated" in note
    assert devices.precision_on("32", cpu) == ("32", None)
    precision, note = devices.precision_on("tf32", cpu)  # no TF32 there: float32, which it would compute anyway
    assert precision == "32" and "this run computes in float32" in note
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    precision, note = devices.precision_on("tf32", gpu)
    assert precision == "32" and "Tesla T4 has no TF32 tensor cores" in note
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert devices.precision_on("tf32", gpu) == ("tf32", None)


def test_tf32_sets_torchs_matrix_products_for_the_run_alone_and_its_peak_is_the_tensor_cores() -> None:
    """--precision tf32 within a run: torch's float32 matrix products at "high" (TF32) and cuDNN's convolutions
    allowed it; what the process had before, after it (fit may run again). The MFU's peak: the GPU's dense TF32
    figure, or its float32 one where it has no TF32 tensor cores."""
    from paratrain.features.precision import float32_math
    from paratrain.runtime.peaks import gpu_peak

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with float32_math("tf32"):
            assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == before[0] and not torch.backends.cudnn.allow_tf32
        with float32_math("32"):
            assert torch.get_float32_matmul_precision() == before[0]
    finally:
        torch.backends.cudnn.allow_tf32 = before[1]
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "tf32") == 156e12 and gpu_peak("NVIDIA H100 80GB HBM3", "tf32") == 494e12
    assert gpu_peak("Tesla V100-SXM2-16GB", "tf32") == gpu_peak("Tesla V100-SXM2-16GB", "32") == 15.7e12


@pytest.mark.parametrize(("offload", "backend"), [(False, "nccl"), (True, "cuda:nccl,cpu:gloo")])
def test_gpu_workers_wait_blocking_and_offloaded_gradients_get_a_cpu_backend(
        monkeypatch: pytest.MonkeyPatch, offload: bool, backend: str) -> None:
    """A GPU worker's group: NCCL whose waits block (TORCH_NCCL_BLOCKING_WAIT, unless the user set it), so that a
    collective past --collective-timeout raises in the worker that waits, where NCCL's watchdog aborted the
    process; with --cpu-offload, gloo beside it for the collectives over CPU tensors (the offloaded gradients'
    norm and histograms)."""
    from paratrain.runtime import dist

    joined: list[tuple[str, str | None]] = []
    monkeypatch.setattr(dist, "device_for", lambda name: torch.device(name))
    monkeypatch.setattr(dist.dist, "init_process_group",
                        lambda backend, **kwargs: joined.append((backend, os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))))
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    ctx = dist.init(0, 2, "cuda:0", cpu_collectives=offload)
    assert joined == [(backend, "1")] and ctx.backend == backend
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the user's choice is kept
    dist.init(0, 2, "cuda:0", cpu_collectives=offload)
    assert joined[-1] == (backend, "0")
    monkeypatch.setattr(dist, "device_for", lambda name: torch.device("cpu"))
    dist.init(0, 2, "cpu")
    assert joined[-1][0] == "gloo"


def test_a_collective_that_timed_out_is_named_where_the_error_names_it() -> None:
    from paratrain.parallel.launch import _collective, _timed_out

    nccl = RuntimeError("[Rank 1] Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, Timeout(ms)=5000) "
                        "timed out in blocking wait.")
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation")
    assert _timed_out(nccl) and _timed_out(gloo)
    assert _collective(nccl) == " (ALLREDUCE, the group's collective number 7)" and _collective(gloo) == ""
