"""paratrain bench and report: configuration parsing, and the report files of a tiny bench."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import in_session, left_in_session, main_code, max_abs_diff, run_cli, train_here, weights

from paratrain.core.errors import UserError
from paratrain.measure.bench import add_speedups, default_configs, parse_configs
from paratrain.runtime.devices import usable_cores


def test_parse_configs() -> None:
    configs = parse_configs("cpu:1t,cpu:2t,ddp-cpu:2,gpu:1,gpu:2,tower-gpu:2")
    assert [c.name for c in configs] == ["cpu:1t", "cpu:2t", "ddp-cpu:2", "gpu:1", "gpu:2", "tower-gpu:2"]
    assert configs[1].flags == ("--accelerator", "cpu", "--devices", "1", "--threads-per-worker", "2")
    assert configs[5].flags == ("--accelerator", "gpu", "--devices", "2", "--strategy", "tower")
    assert [c.devices for c in configs] == [1, 1, 2, 1, 2, 2]
    pipe, hybrid = parse_configs("pipeline-gpu:2x8,hybrid-cpu:2x3")
    assert pipe.family == "pipeline-gpu" and pipe.devices == 2
    assert pipe.flags == ("--accelerator", "gpu", "--devices", "2", "--strategy", "pipeline", "--stages", "2",
                          "--microbatches", "8")
    assert hybrid.family == "hybrid-cpu" and hybrid.devices == 6 and "hybrid" in hybrid.flags


@pytest.mark.parametrize("spec", ["cpu:2", "ddp-cpu:2t", "tpu:1", "gpu:0", "gpu:x", ",", "pipeline-cpu:1x4",
                                  "pipeline-cpu:2", "hybrid-tpu:2x2"])
def test_bad_configs(spec: str) -> None:
    with pytest.raises(UserError, match="--configs"):
        parse_configs(spec)


def test_default_configs() -> None:
    assert [c.name for c in default_configs(2, 0)] == ["cpu:1t", "cpu:2t", "ddp-cpu:1", "ddp-cpu:2", "tower-cpu:2"]
    assert [c.name for c in default_configs(4, 2)] == ["cpu:1t", "cpu:4t", "gpu:1", "gpu:2", "tower-gpu:2"]
    assert [c.name for c in default_configs(128, 1)] == ["cpu:1t", "cpu:128t", "gpu:1"]  # no tower of 128 CPUs
    assert [c.name for c in default_configs(96, 0)] == ["cpu:1t", "cpu:96t", *(f"ddp-cpu:{n}" for n in
                                                        (1, 2, 4, 8, 16, 32, 64, 96)), "tower-cpu:96"]


def test_bench_without_configs_on_a_gpu_node_plans_a_dozen_rows_and_every_gpu_count(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`paratrain bench` with no --configs on 128 cores and 8 GPUs (faked): the rows it would run are at most
    12, two of them the CPU's, and one for each GPU count."""
    import torch

    from paratrain.measure import bench
    from paratrain.runtime import devices

    monkeypatch.setattr(devices, "usable_cores", lambda: 128)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    planned: list[str] = []

    def measured(configs: list, *args: object, **kwargs: object) -> dict:
        planned.extend(c.name for c in configs)
        raise SystemExit(0)  # what would run is known: nothing runs, nothing is reported
    monkeypatch.setattr(bench, "run_bench", measured)
    assert main_code(["bench", "--dataset", "digits", "--steps", "1", "--out", str(tmp_path / "b")]) == 0
    assert len(planned) <= 12 and [n for n in planned if "cpu" in n] == ["cpu:1t", "cpu:128t"], planned
    assert {f"gpu:{n}" for n in range(1, 9)} <= set(planned) and "tower-gpu:8" in planned, planned


def test_speedups() -> None:
    rows = [{"name": "ddp-cpu:1", "family": "ddp-cpu", "devices": 1, "status": "ok", "examples_per_sec": {"mean": 100}},
            {"name": "ddp-cpu:2", "family": "ddp-cpu", "devices": 2, "status": "ok", "examples_per_sec": {"mean": 150}},
            {"name": "gpu:2", "family": "gpu", "devices": 2, "status": "ok", "examples_per_sec": {"mean": 9}},
            {"name": "x", "family": "gpu", "devices": 1, "status": "failed", "error": "boom"}]
    add_speedups(rows)
    assert rows[1]["speedup"] == 1.5 and rows[1]["efficiency"] == 0.75
    assert rows[2]["speedup"] is None  # no gpu:1 baseline


def test_the_workload_is_any_train_options_as_train_takes_them() -> None:
    from paratrain.cli import build_parser
    from paratrain.cli.bench import as_flags, workload

    args = build_parser().parse_args(["bench", "--out", "o", "--model", "nets.py:build", "--dataset", "imagefolder",
                                      "--data-dir", "imgs", "--image-size", "32", "--no-download", "--precision",
                                      "bf16", "--steps", "5"])
    values = workload(args)
    assert values == {"model": "nets.py:build", "dataset": "imagefolder", "data_dir": "imgs", "download": False,
                      "image_size": 32, "precision": "bf16", "steps": 5}
    flags = as_flags(values)
    assert build_parser().parse_args(["train", *flags]).model == "nets.py:build"  # train takes them back
    assert "--no-download" in flags and flags[flags.index("--image-size") + 1] == "32"
    assert workload(build_parser().parse_args(["bench", "--out", "o"])) == {"dataset": "mnist", "epochs": 2}
    with pytest.raises(SystemExit):  # what each configuration sets is not the workload's
        build_parser().parse_args(["bench", "--out", "o", "--devices", "2"])


@pytest.mark.integration
def test_a_bench_of_ones_own_network_on_an_image_folder(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import make_shapes

    make_shapes.write(tmp_path / "shapes", per_class=10)
    net = Path(__file__).resolve().parents[1] / "examples" / "residual_cnn.py"
    proc = run_cli("bench", "--model", f"{net}:build", "--dataset", "imagefolder", "--data-dir",
                   str(tmp_path / "shapes"), "--steps", "4", "--batch-size", "8", "--repeats", "1", "--configs",
                   "ddp-cpu:2", "--out", str(tmp_path / "b"), timeout=600)  # one row: the bench's own test is above
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["results"]
    assert [r["status"] for r in rows] == ["ok"], [r.get("error") for r in rows]
    summary = json.loads((tmp_path / "b" / "runs" / "ddp-cpu-2-r0" / "summary.json").read_text())
    assert summary["dataset"] == "imagefolder" and summary["model"] == f"{net}:build" and summary["world_size"] == 2


@pytest.mark.integration
def test_tiny_bench_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    all_cores = f"cpu:{usable_cores()}t"  # one process with every core: what ddp-cpu:1 runs as
    proc = run_cli("bench", "--dataset", "synthetic", "--steps", "8", "--repeats", "1", "--configs",
                   f"ddp-cpu:1,ddp-cpu:2,gpu:64,{all_cores},pipeline-cpu:2x2", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert {"context", "train_flags", "repeats", "results"} <= report.keys()
    ok, failed, same, pipe = report["results"][:2], *report["results"][2:]
    assert same["name"] == all_cores and same["same_as"] == "ddp-cpu:1" and same["family"] == "cpu"
    assert same["examples_per_sec"] == ok[0]["examples_per_sec"]  # measured once, not twice
    assert not list((out / "runs").glob("cpu-*"))
    assert failed["status"] == "failed" and failed["error"]  # reported, and the others still ran
    for row in ok:
        assert row["status"] == "ok"
        assert {"examples_per_sec", "epoch_time_s", "eval_time_s", "total_time_s", "speedup", "efficiency",
                "step_phases_s", "epoch_times_s"} <= row.keys()
        assert row["examples_per_sec"]["mean"] > 0
        assert set(row["step_phases_s"]) == {"data", "compute", "allreduce", "optimizer"}
    assert ok[0]["speedup"] == 1.0 and ok[1]["step_phases_s"]["allreduce"] > 0
    for name in ("report.md", "epoch_times.png", "times.png", "scaling.png", "breakdown.png"):
        assert (out / name).stat().st_size > 0
    text = (out / "report.md").read_text()
    assert "| ddp-cpu:2 | 2 |" in text
    assert pipe["status"] == "ok" and pipe["step_phases_s"] is None  # no --time-phases in a pipeline
    assert pipe["pipeline"]["bubble"]["theoretical"] == pytest.approx(1 / 3)
    assert "| pipeline-cpu:2x2 | 2 |" in text and "in theory" in text


@pytest.mark.integration
def test_a_bench_killed_outright_leaves_no_run_behind(tmp_path: Path) -> None:
    """kill -9 of the bench alone, its run on 2 workers training: the run (forked from the bench's forkserver)
    and its workers end with it. A run the bench started as a subprocess trained on to its end."""
    out = tmp_path / "b"
    bench = subprocess.Popen([sys.executable, "-m", "paratrain", "bench", "--dataset", "synthetic", "--steps", "100000",
                              "--repeats", "1", "--configs", "ddp-cpu:2", "--out", str(out)],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "runs" / "ddp-cpu-2-r0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()) and bench.poll() is None:
            assert time.monotonic() < deadline, "the bench's run logged nothing in 120 s"
            time.sleep(0.2)
        assert bench.poll() is None, bench.stderr.read()[-3000:]
        assert len(in_session(bench.pid)) >= 4  # the bench, its forkserver, its run, the run's workers (and theirs)
        os.kill(bench.pid, signal.SIGKILL)
        assert not (left := left_in_session(bench.pid, 30)), f"processes of the killed bench still run: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)


@pytest.mark.integration
def test_report_of_finished_runs(tmp_path: Path) -> None:
    a = train_here(tmp_path / "a", "--steps", "10", "--devices", "1")
    proc = run_cli("report", str(tmp_path / "a"), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "rep" / "report.md").read_text()
    # the run's own examples/s, one value without a spread, and no plot or block with nothing to show
    assert f"| a | 1 | {a['examples_per_sec']:,.0f} |" in text, text
    assert "±" not in text and "Training flags" not in text
    assert not (tmp_path / "rep" / "scaling.png").exists() and not (tmp_path / "rep" / "breakdown.png").exists()
    assert "scaling.png" not in text and (tmp_path / "rep" / "epoch_times.png").exists()
    train_here(tmp_path / "b", "--steps", "10", "--devices", "2", "--time-phases")
    proc = run_cli("report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep3"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "rep3" / "scaling.png").exists() and (tmp_path / "rep3" / "breakdown.png").exists()
    proc = run_cli("report", str(tmp_path / "nothing"), "--out", str(tmp_path / "rep2"))
    assert proc.returncode == 2 and "is not a finished paratrain run" in proc.stderr


@pytest.mark.integration
def test_timed_phases_train_the_same_weights(tmp_path: Path) -> None:
    """--time-phases swaps DDP's overlapped all-reduce for an explicit one after backward: same update."""
    args = ("--steps", "6", "--devices", "2", "--optimizer", "sgd", "--batch-size", "64")
    plain = train_here(tmp_path / "plain", *args)
    timed = train_here(tmp_path / "timed", *args, "--time-phases")
    assert plain["step_phases_s"] is None
    assert set(timed["step_phases_s"]) == {"data", "compute", "allreduce", "optimizer"}
    assert timed["step_phases_s"]["allreduce"] > 0
    assert max_abs_diff(weights(tmp_path / "plain"), weights(tmp_path / "timed")) < 1e-6


def test_a_report_of_runs_draws_one_scaling_curve_per_workload(tmp_path: Path) -> None:
    """LeNet-5 on 1 and 2 devices and an MLP on 2: the scaling plot joins the LeNet-5 runs only."""
    import json

    from paratrain.measure import bench, plot

    for name, model, n, rate in (("a", "lenet5", 1, 5000.0), ("b", "lenet5", 2, 8000.0), ("c", "mlp", 2, 1600.0)):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({
            "model": model, "dataset": "digits", "global_batch_size": 64, "strategy": "ddp",
            "world_size": n, "train_time_s": 1.0, "eval_time_s": 0.1, "examples_per_sec": rate,
            "test_accuracy": 0.9}))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "epoch": 1, "epoch_time_s": 1.0}) + "\n")
    (tmp_path / "c" / "config.yaml").write_text("model: mlp\nwidth: 64\ndepth: 2\n")  # depth 2: the default
    rows = [bench.result_from_run(tmp_path / name) for name in "abc"]
    assert [r["family"] for r in rows] == ["ddp: lenet5 on digits, batch 64"] * 2 + [
        "ddp: mlp on digits, width 64, batch 64"]
    assert "scaling.png" in plot._plots(rows)  # lenet5's two device counts
    assert "scaling.png" not in plot._plots([rows[0], rows[2]])  # one device count of each workload: no curve
    bench.add_run_speedups(rows)  # against the workload's own 1-device run; the MLP has none
    assert [(r["speedup"], r["efficiency"]) for r in rows] == [(1.0, 1.0), (1.6, 0.8), (None, None)]
    text = plot.write_report({"context": bench.context(), "results": rows}, tmp_path, rates="summary").read_text()
    assert "| b | 2 | 8,000 | 1.60x | 80% |" in text and "| c | 2 | 1,600 | - | - |" in text, text
    assert "the first 1-device run of the same workload" in text


def test_a_configuration_the_workload_cannot_run_on_is_known_before_any_run(tmp_path: Path) -> None:
    from paratrain.cli.bench import _refused
    from paratrain.measure.bench import run_bench

    configs = parse_configs("tower-cpu:2,pipeline-cpu:2x2")
    why = [_refused(c, {"dataset": "digits", "steps": 5, **refused})
           for c, refused in zip(configs, ({"compile": True}, {"precision": "16-mixed"}), strict=True)]
    assert "--compile is not available with --strategy tower" in why[0] and "pipeline" in why[1], why
    assert [_refused(c, {"dataset": "digits", "steps": 5}) for c in configs] == [None, None]

    def ran(argv: list[str]) -> None:  # the bench's runner: raised past its handling of a run's failure
        pytest.fail(f"a refused configuration ran: {argv}")
    report = run_bench(configs, ["--steps", "5"], 1, tmp_path, ran, refused=lambda c: "no")
    assert [r["status"] for r in report["results"]] == ["failed", "failed"] and not (tmp_path / "runs").exists()


def test_fsdp_rows_train_the_sharded_strategy() -> None:
    cpu, gpu = parse_configs("fsdp-cpu:2,fsdp-gpu:4")
    assert (cpu.family, cpu.devices) == ("fsdp-cpu", 2)
    assert cpu.flags == ("--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp")
    assert gpu.flags == ("--accelerator", "gpu", "--devices", "4", "--strategy", "fsdp")
    with pytest.raises(UserError, match="fsdp-cpu:N"):
        parse_configs("fsdp:2")
