"""The GPU paths: NCCL data parallelism and the dataset on the device. Skipped without CUDA."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from conftest import max_abs_diff, run_cli, train, train_here, weights

pytestmark = pytest.mark.gpu  # sees the GPUs (conftest hides them from every other test)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than 2 CUDA GPUs here")


@needs_gpu
def test_one_gpu_trains_digits(tmp_path: Path) -> None:
    summary = train(tmp_path / "gpu", "--accelerator", "gpu", "--devices", "1")
    assert summary["devices"][0].startswith("cuda:0")
    assert summary["test_accuracy"] >= 0.95


@needs_gpu
def test_a_gpu_runs_files_hold_cpu_tensors(tmp_path: Path) -> None:
    """What a GPU run writes in one file loads on a machine without a GPU (torch.load with no map_location): a
    checkpoint's meta.pt (scheduler, scaler, step) and `paratrain export`'s weights, with the optimizer's
    state (Adam's moments) among what was saved."""
    train(tmp_path / "run", "--accelerator", "gpu", "--devices", "1", "--steps", "4", "--optimizer", "adam",
          "--checkpoint-every", "2")
    proc = run_cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "w.pt"))
    assert proc.returncode == 0, proc.stderr
    files = [tmp_path / "w.pt", *sorted((tmp_path / "run" / "checkpoints").glob("step-*/meta.pt"))]
    assert len(files) >= 2
    for f in files:
        tensors = torch.utils._pytree.tree_leaves(torch.load(f, weights_only=True))
        assert {t.device.type for t in tensors if isinstance(t, torch.Tensor)} <= {"cpu"}, f


@needs_gpu
def test_gpu_matches_cpu(tmp_path: Path) -> None:
    """Same seed, same batches: a GPU run and a CPU run differ only by floating-point rounding."""
    args = ("--steps", "20", "--optimizer", "sgd", "--lr", "0.01", "--batch-size", "64", "--devices", "1")
    train(tmp_path / "gpu", *args, "--accelerator", "gpu")
    train(tmp_path / "cpu", *args, "--accelerator", "cpu")
    # Not yet measured on a GPU (no session so far was lent one): cuDNN's reductions are not the CPU's, and
    # lr 0.01 keeps the run far from where float noise grows (lr 0.05: 1.4e-5 between CPU worker counts)
    assert max_abs_diff(weights(tmp_path / "gpu"), weights(tmp_path / "cpu")) < 1e-3


@needs_gpu
def test_the_gpt_trains_on_one_gpu_in_bf16_and_reports_its_mfu(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    pages = sorted(Path(__file__).parents[1].joinpath("docs").rglob("*.md"))
    text.write_text("\n\n".join(p.read_text() for p in pages))
    summary = train(tmp_path / "gpt", "--accelerator", "gpu", "--devices", "1", "--dataset", "text", "--data-dir",
                    str(text), "--width", "256", "--depth", "4", "--context", "128", "--batch-size", "32",
                    "--optimizer", "adamw", "--precision", "bf16", "--steps", "50", "--no-tensorboard")
    assert summary["precision"] == "bf16" and summary["tokens_per_sec"] > 0
    print({k: summary[k] for k in ("tokens_per_sec", "achieved_flops_per_sec", "peak_of", "mfu")})
    if "not in paratrain's table" not in summary["peak_of"]:
        assert 0 < summary["mfu"] < 1


@needs_2_gpus
def test_gpus_equal_one_gpu_on_mnist(tmp_path: Path, mnist_dir: Path) -> None:
    n = torch.cuda.device_count()
    args = ("--accelerator", "gpu", "--dataset", "mnist", "--data-dir", str(mnist_dir), "--steps", "20",
            "--optimizer", "sgd", "--lr", "0.01", "--batch-size", str(128 * n))
    one = train(tmp_path / "one", *args, "--devices", "1")
    many = train(tmp_path / "many", *args, "--devices", str(n))
    assert many["world_size"] == n and one["world_size"] == 1
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "many")) < 1e-4


@needs_gpu
@pytest.mark.parametrize("precision", ["bf16", "16-mixed"])
def test_mixed_precision_on_gpu(tmp_path: Path, precision: str) -> None:
    summary = train(tmp_path / precision, "--accelerator", "gpu", "--devices", "1", "--precision", precision,
                    "--steps", "100")
    assert summary["precision"] == precision and summary["test_accuracy"] >= 0.8


@needs_gpu
def test_tf32_is_a_float32_run_whose_matrix_products_use_the_tensor_cores(tmp_path: Path) -> None:
    """--precision tf32 on an Ampere or later GPU: recorded as such, its MFU over the table's TF32 peak, its losses
    those of float32 to TF32's rounding, and the process's matrix-product setting put back after; before
    Ampere, float32 with a note."""
    from paratrain.runtime.devices import TF32_CAPABILITY
    from paratrain.runtime.peaks import gpu_peak

    text = tmp_path / "text.txt"
    pages = sorted(Path(__file__).parents[1].joinpath("docs").rglob("*.md"))
    text.write_text("\n\n".join(p.read_text() for p in pages))
    args = ("--accelerator", "gpu", "--devices", "1", "--dataset", "text", "--data-dir", str(text), "--width", "256",
            "--context", "64", "--batch-size", "16", "--optimizer", "adamw", "--steps", "20", "--no-tensorboard")
    single = train_here(tmp_path / "32", *args)
    before = torch.get_float32_matmul_precision()
    tf32 = train_here(tmp_path / "tf32", *args, "--precision", "tf32")
    assert torch.get_float32_matmul_precision() == before
    has_tf32 = torch.cuda.get_device_capability(0) >= TF32_CAPABILITY
    assert tf32["precision"] == ("tf32" if has_tf32 else "32")
    peak = gpu_peak(torch.cuda.get_device_name(0), tf32["precision"])
    if peak is not None:
        assert tf32["peak_flops_per_sec"] == peak and single["peak_flops_per_sec"] == gpu_peak(
            torch.cuda.get_device_name(0), "32")
    assert abs(tf32["val_loss"] - single["val_loss"]) < 1e-2 * max(1.0, single["val_loss"])


@needs_gpu
def test_text_through_the_feed_on_a_gpu_trains_as_reading_each_batch_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data/feed.py on a GPU: the next micro-batch read into pinned memory and copied on a side stream while this
    one trains, against each read in the loop's thread: the same weights (to the GPU's own run-to-run rounding)."""
    text = tmp_path / "text.txt"
    pages = sorted(Path(__file__).parents[1].joinpath("docs").rglob("*.md"))
    text.write_text("\n\n".join(p.read_text() for p in pages))
    args = ("--accelerator", "gpu", "--devices", "1", "--dataset", "text", "--data-dir", str(text), "--width", "64",
            "--context", "64", "--batch-size", "16", "--accumulate", "2", "--optimizer", "adamw", "--steps", "30",
            "--no-tensorboard")
    train_here(tmp_path / "ahead", *args)
    monkeypatch.setattr("paratrain.training.trainer.reads_ahead", lambda train, device: False)
    train_here(tmp_path / "asked", *args)
    assert max_abs_diff(weights(tmp_path / "ahead"), weights(tmp_path / "asked")) < 1e-5


@needs_gpu
def test_host_data_on_a_gpu_trains_as_the_dataset_moved_whole(tmp_path: Path) -> None:
    """--host-data: the digits kept in host memory, each batch copied pinned and read ahead, against the dataset
    on the GPU whole."""
    args = ("--accelerator", "gpu", "--devices", "1", "--steps", "40", "--optimizer", "adam")
    whole = train(tmp_path / "whole", *args)
    host = train(tmp_path / "host", *args, "--host-data")
    assert max_abs_diff(weights(tmp_path / "whole"), weights(tmp_path / "host")) < 1e-5
    assert abs(host["test_accuracy"] - whole["test_accuracy"]) < 1e-3


@needs_gpu
def test_each_run_in_one_process_reports_its_own_gpu_peak(tmp_path: Path) -> None:
    """Two runs in this process, a wide network's then a narrow one's: the second's peak is its own, not the
    process's (torch's peak counter was never reset: a search's trials and repeated fits reported the largest)."""
    wide = train_here(tmp_path / "wide", "--accelerator", "gpu", "--devices", "1", "--model", "mlp", "--width", "8192",
                      "--steps", "2")
    gc.collect()  # what the first run left to the collector goes first: the point is the counter
    narrow = train_here(tmp_path / "narrow", "--accelerator", "gpu", "--devices", "1", "--model", "mlp", "--width",
                        "16", "--steps", "2")
    assert narrow["peak_memory_bytes"][0] * 10 < wide["peak_memory_bytes"][0], (narrow, wide)


@needs_2_gpus
def test_two_stage_pipeline_on_gpus_equals_one_gpu(tmp_path: Path) -> None:
    """The pipeline on NCCL: stage 0 on cuda:0, stage 1 on cuda:1, micro-batches sent between them."""
    args = ("--accelerator", "gpu", "--steps", "10", "--optimizer", "sgd", "--lr", "0.01", "--batch-size", "64")
    train(tmp_path / "one", *args, "--devices", "1")
    summary = train(tmp_path / "pipe", *args, "--strategy", "pipeline", "--stages", "2", "--microbatches", "4")
    assert summary["world_size"] == 2 and summary["strategy"] == "pipeline"
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "pipe")) < 1e-3


@needs_2_gpus
def test_tensor_parallel_gpt_on_gpus_equals_one_gpu(tmp_path: Path) -> None:
    """The gpt split over 2 GPUs (NCCL, DTensor) by its plan, and 2 sharded copies of it where there are 4,
    against one GPU: AdamW, 20 steps, fp32."""
    text = tmp_path / "text.txt"
    pages = sorted(Path(__file__).parents[1].joinpath("docs").rglob("*.md"))
    text.write_text("\n\n".join(p.read_text() for p in pages))
    args = ("--accelerator", "gpu", "--dataset", "text", "--data-dir", str(text), "--width", "128", "--heads", "4",
            "--context", "64", "--batch-size", "16", "--optimizer", "adamw", "--steps", "20", "--no-tensorboard")
    one = train(tmp_path / "one", *args, "--devices", "1")
    layouts = {"tp": ("--strategy", "tp", "--devices", "2")}
    if torch.cuda.device_count() >= 4:
        layouts["mesh"] = ("--mesh", "fsdp=2,tp=2")
    for name, flags in layouts.items():
        split = train(tmp_path / name, *args, *flags)
        assert split["strategy"] == "tp" and abs(split["val_loss"] - one["val_loss"]) < 1e-4
        assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / name)) < 1e-3, name


@needs_2_gpus
def test_the_doctor_passes_on_two_gpus_with_nccl(tmp_path: Path) -> None:
    """The NCCL sweep and every 1-vs-2 check on real GPUs (benchmarks/gpu_acceptance.sh runs this)."""
    proc = run_cli("doctor", "--devices", "2", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["devices"]["backend"] == "nccl" and all(r["wrong"] == 0 for r in report["collectives"]["rows"])
    assert [e["strategy"] for e in report["equivalence"]] == ["ddp", "tower", "pipeline"]


@needs_gpu
def test_fsdp_on_gpus_equals_one_gpu_and_offloads_its_shards(tmp_path: Path) -> None:
    """fsdp on NCCL (every GPU, or one: the plain module, its checkpoint sharded) equals one GPU; with
    --cpu-offload each shard lives in CPU memory, so a GPU's allocated peak falls."""
    n = torch.cuda.device_count()
    args = ("--accelerator", "gpu", "--model", "mlp", "--width", "2048", "--steps", "10", "--optimizer", "sgd",
            "--lr", "0.01", "--batch-size", str(64 * n))
    train(tmp_path / "one", *args, "--devices", "1")
    sharded = train(tmp_path / "fsdp", *args, "--devices", str(n), "--strategy", "fsdp")
    assert sharded["strategy"] == "fsdp" and sharded["world_size"] == n
    assert max_abs_diff(weights(tmp_path / "one"), weights(tmp_path / "fsdp")) < 1e-4
    if n > 1:
        offloaded = train(tmp_path / "offload", *args, "--devices", str(n), "--strategy", "fsdp", "--cpu-offload")
        assert max_abs_diff(weights(tmp_path / "offload"), weights(tmp_path / "fsdp")) < 1e-5
        assert max(offloaded["peak_memory_bytes"]) < max(sharded["peak_memory_bytes"])
