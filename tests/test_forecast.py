"""The scaling planner's cost model on known inputs, and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from paratrain.measure.scaling import Workload, predict, ring_allreduce_s, step_time_s


def test_ring_allreduce_formula() -> None:
    # 8 devices, 100 MB at 10 GB/s, 5 us: 2*7/8*0.01 s + 14*5 us
    assert ring_allreduce_s(8, 100e6, 10e9, 5e-6) == pytest.approx(0.0175 + 70e-6)
    assert ring_allreduce_s(1, 100e6, 10e9, 5e-6) == 0.0
    assert ring_allreduce_s(2, 4e6, 1e9, 0.0) == pytest.approx(4e-3)  # 2(N-1)/N = 1 for two devices


def test_step_time_with_and_without_overlap() -> None:
    w = Workload(compute_per_example_s=1e-4, fixed_per_step_s=1e-3, grad_bytes=1e9)
    # compute 100 x 1e-4 = 10 ms; comm for 4 devices: 1.5 x 1e9 / 1e11 = 15 ms (no latency)
    assert step_time_s(w, 4, 100, 1e11, 0.0, overlap=False) == pytest.approx(0.010 + 0.001 + 0.015)
    # overlap hides 2/3 x 10 ms of the 15 ms
    assert step_time_s(w, 4, 100, 1e11, 0.0, overlap=True) == pytest.approx(0.010 + 0.001 + 0.015 - 0.010 * 2 / 3)
    # latency: 2(N-1) messages for the gradients and as many for the 24-byte flags, which are never hidden
    no_data = Workload(compute_per_example_s=1e-4, fixed_per_step_s=0.0, grad_bytes=0.0)
    assert step_time_s(no_data, 4, 100, float("inf"), 1e-5, overlap=False) == pytest.approx(0.010 + 12e-5)
    assert step_time_s(no_data, 4, 100, float("inf"), 1e-5, overlap=True) == pytest.approx(0.010 + 6e-5)


def test_weak_and_strong_scaling() -> None:
    w = Workload(1e-4, 0.0, 0.0)  # no communication: perfect scaling either way
    free = float("inf")  # an infinitely fast link with no latency
    assert predict(w, 16, free, 0.0, False, per_device_batch=64)["efficiency"] == pytest.approx(1.0)
    strong = predict(Workload(1e-4, 1e-3, 0.0), 4, free, 0.0, False, global_batch=400)
    # one device: 400 ex in 41 ms; four: 100 ex each in 11 ms -> 400 / 0.011
    assert strong["examples_per_sec"] == pytest.approx(400 / 0.011)
    assert strong["speedup"] == pytest.approx(0.041 / 0.011)


@pytest.mark.integration
def test_plan_command(tmp_path: Path) -> None:
    results = {"train_flags": ["--model", "lenet5", "--dataset", "mnist"], "results": [
        {"name": "cpu:1t", "family": "cpu", "devices": 1, "status": "ok", "global_batch_size": 512,
         "examples_per_sec": {"mean": 5000.0}, "step_phases_s": {"data": 0.002, "compute": 0.1, "allreduce": 0.0,
                                                                 "optimizer": 0.001}},
        {"name": "ddp-cpu:2", "family": "ddp-cpu", "devices": 2, "status": "ok", "global_batch_size": 512,
         "examples_per_sec": {"mean": 9000.0}, "step_phases_s": None}]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    proc = run_cli("plan", "--results", str(tmp_path), "--link", "ib-ndr", "--max-devices", "1024",
                   "--out", str(tmp_path / "plan"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.split()[:1] == ["1024"] for line in lines)
    assert "ddp-cpu:2" in proc.stdout and "error" in proc.stdout
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert len(saved["rows"]) == 11 and (tmp_path / "plan" / "plan.png").exists()
    bad = run_cli("plan", "--results", str(tmp_path), "--link", "carrier-pigeon")
    assert bad.returncode == 2 and "unknown --link 'carrier-pigeon'" in bad.stderr


@pytest.mark.slow
@pytest.mark.alone  # its co-location slowdown is a ratio of measured times: nothing beside it
def test_plan_checks_itself_against_measured_gloo_workers(tmp_path: Path) -> None:
    """A real bench of 1 thread and 2 gloo workers, then the plan: it measures this host (link, co-location)
    and puts its prediction for the 2 workers beside the measurement. How close they come is a timing, so
    it lives in benchmarks/plan_accuracy.py (target: within 20%), not here: on this noisy 2-core machine the
    same check gave 4%, 8%, 21% and 29% on different runs."""
    out = tmp_path / "bench"
    proc = run_cli("bench", "--dataset", "synthetic", "--configs", "cpu:1t,ddp-cpu:2", "--steps", "120",
                   "--repeats", "1", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("plan", "--results", str(out), "--max-devices", "2", "--link", "measured", "--out",
                   str(tmp_path / "plan"))  # measured (the default, said here): the link the CPU check used
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan_json = json.loads((tmp_path / "plan" / "plan.json").read_text())
    (check,) = plan_json["validation"]
    bench = json.loads((out / "results.json").read_text())
    (row,) = [r for r in bench["results"] if r["name"] == "ddp-cpu:2"]
    # the plan stands beside the bench's own measurement, and predicts from its measured link and workload
    assert check["name"] == "ddp-cpu:2" and check["measured"] == row["examples_per_sec"]["mean"] > 0
    from paratrain.measure.scaling import Workload, predict, workload_from_bench

    w, _ = workload_from_bench(bench)
    w = Workload(w.compute_per_example_s * check["colocation_slowdown"], w.fixed_per_step_s, w.grad_bytes)
    expected = predict(w, 2, plan_json["bandwidth"], plan_json["latency"], overlap=False,
                       global_batch=row["global_batch_size"])["examples_per_sec"]
    assert check["predicted"] == pytest.approx(expected, rel=1e-9) and check["predicted"] > 0
    assert 0.5 < check["colocation_slowdown"] < 5  # measured here: two 1-thread processes on 2 cores
    assert "ddp-cpu:2" in proc.stdout and "error" in proc.stdout


def test_fsdp_moves_one_and_a_half_times_the_bytes_and_updates_a_shard() -> None:
    from paratrain.measure.scaling import sharded_traffic_s, validate

    nbytes, bw = 4e8, 1e10
    assert sharded_traffic_s(1, nbytes, bw, 1e-5, 5) == 0.0
    # bytes alone (no latency): 1.5x the ring all-reduce's on every count
    for n in (2, 4, 64):
        assert sharded_traffic_s(n, nbytes, bw, 0.0, 5) == pytest.approx(1.5 * ring_allreduce_s(n, nbytes, bw, 0.0))
    # one message per block for each of the three collectives
    assert sharded_traffic_s(2, 0.0, bw, 1e-5, 5) == pytest.approx(3 * 1 * 1e-5 * 5)
    w = Workload(1e-4, 0.010, nbytes, optimizer_per_step_s=0.008, blocks=5)
    plain = step_time_s(w, 4, 64, bw, 0.0, overlap=False)
    sharded = step_time_s(w, 4, 64, bw, 0.0, overlap=False, sharded=True)
    # the optimizer's 8 ms falls to 2 ms; the traffic grows by half of the all-reduce's
    assert sharded - plain == pytest.approx(-0.006 + 0.5 * ring_allreduce_s(4, nbytes, bw, 0.0))
    assert predict(w, 1, bw, 0.0, False, per_device_batch=64, sharded=True)["efficiency"] == pytest.approx(1.0)
    # a bench's fsdp-cpu row is predicted with the sharded model, beside its ddp-cpu twin
    rows = [{"name": name, "status": "ok", "family": family, "devices": 2, "global_batch_size": 128,
             "examples_per_sec": {"mean": 1000.0}} for name, family in (("ddp-cpu:2", "ddp-cpu"),
                                                                         ("fsdp-cpu:2", "fsdp-cpu"))]
    checks = {c["name"]: c for c in validate({"results": rows}, w, bw, 0.0)}
    assert checks["fsdp-cpu:2"]["predicted"] != checks["ddp-cpu:2"]["predicted"]
    assert checks["fsdp-cpu:2"]["predicted"] == pytest.approx(
        predict(w, 2, bw, 0.0, False, global_batch=128, sharded=True)["examples_per_sec"])
