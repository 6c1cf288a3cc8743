"""paratrain doctor: the inventory, the all-reduce sweep and its checks, the 1-vs-N training check, failures
that give a non-zero exit and their one line, and the link file `paratrain plan --link FILE` reads."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from conftest import run_cli

from paratrain.core.errors import UserError
from paratrain.measure import doctor
from paratrain.measure.doctor import Check, collective_checks, equivalence_checks, partition_check, read_link
from paratrain.measure.doctor.collectives import bus_factor, fit
from paratrain.runtime.tcp_timeout import agent_wait, fitting, give_up_s

# its integration tests bound wall times or compare measured rates: .ci/run runs them with nothing beside
pytestmark = pytest.mark.alone


def _rows(bandwidth: float, latency: float, n: int = 2) -> list[dict]:
    """A sweep as the ring model times it, exactly."""
    rows = []
    for nbytes in (4, 64, 1024, 4096, 2**20, 64 * 2**20):
        t = bus_factor(n) * nbytes / bandwidth + 2 * (n - 1) * latency
        rows.append({"bytes": nbytes, "time_s": t, "algbw": nbytes / t, "busbw": nbytes / t * bus_factor(n),
                     "wrong": 0, "repeats": 3})
    return rows


def test_the_fit_recovers_the_ring_models_bandwidth_and_latency() -> None:
    fitted = fit(_rows(5e9, 20e-6, n=4), 4)
    assert fitted["bandwidth"] == pytest.approx(5e9, rel=1e-6)
    assert fitted["latency"] == pytest.approx(20e-6, rel=1e-6)
    noisy = _rows(5e9, 20e-6)
    noisy[1]["time_s"] *= 50  # one small message slowed by the host: the latency is their median, unmoved
    assert fit(noisy, 2)["latency"] == pytest.approx(20e-6, rel=1e-6)
    assert fit(_rows(5e9, 20e-6)[:2], 2) is None and bus_factor(8) == pytest.approx(1.75)


def _sweep(rows: list[dict]) -> dict:
    return {"rows": rows, "broadcast_bytes": 4 * 2**20, "broadcast_s": 1e-3, "barrier_s": 5e-5, "fit": fit(rows, 2)}


def test_collective_checks_say_ok_slow_or_failed_with_what_to_do() -> None:
    good = collective_checks(_sweep(_rows(5e9, 20e-6)), None, "gloo", 2, None)
    assert [c.status for c in good] == ["ok", "ok"]
    assert "every element right; bus bandwidth 4.99 GB/s at 64 MB; fitted 5.00 GB/s, 20.0 us a message" in \
        good[0].detail
    wrong = _rows(5e9, 20e-6)
    wrong[4]["wrong"] = 7
    (bad,) = collective_checks(_sweep(wrong), None, "gloo", 2, None)
    assert bad.status == "failed" and "7 wrong elements on 2 gloo workers (first at 1 MB)" in bad.line()
    (hung,) = collective_checks(None, "worker 0: RuntimeError: timed out", "nccl", 2, None)
    assert hung.line() == ("failed all-reduce: NCCL all-reduce failed between GPU 0 and 1: worker 0: RuntimeError: "
                           "timed out: set NCCL_P2P_DISABLE=1 and run again; if that passes, the GPUs' direct link "
                           "is at fault")
    slow = collective_checks(_sweep(_rows(5e9, 20e-6)), None, "nccl", 2, {"kind": "NVLink", "peak_busbw": 370e9})
    assert slow[0].status == "slow" and "below half of NVLink's 370 GB/s" in slow[0].line()


def test_equivalence_checks_fail_above_the_bound() -> None:
    checks = equivalence_checks([{"strategy": "ddp", "devices": 2, "steps": 10, "max_abs_diff": 3e-8, "ok": True},
                                 {"strategy": "tower", "devices": 2, "steps": 10, "max_abs_diff": 0.2, "ok": False},
                                 {"strategy": "pipeline", "devices": 2, "steps": 10, "error": "a stage died",
                                  "ok": False}])
    assert [c.status for c in checks] == ["ok", "failed", "failed"]
    assert checks[0].line() == "ok     1 vs 2 devices, ddp: largest weight difference 3.0e-08 after 10 steps " \
                               "(bound 0.0001)"
    assert "paratrain train --strategy pipeline --devices 2" in checks[2].line()


def test_tcp_gives_up_as_linux_models_it() -> None:
    """tcp_model_timeout: a retransmission timeout that doubles from 200 ms and stays at 120 s after nine."""
    assert [round(give_up_s(r), 1) for r in (3, 5, 8, 9, 15)] == [3.0, 12.6, 102.2, 204.6, 924.6]


def test_the_partition_check_warns_where_tcp_outlasts_the_collective_timeout() -> None:
    quick = partition_check([{"node": 0, "tcp_retries2": 8}, {"node": 1, "tcp_retries2": 5}])
    assert quick.status == "ok" and "ends when TCP gives up, after at least 102 s" in quick.line()
    late = partition_check([{"node": 0, "tcp_retries2": 15}, {"node": 1, "tcp_retries2": 5}])
    assert late.status == "slow" and "net.ipv4.tcp_retries2 = 15 on node 0 (at least 925 s)" in late.line()
    assert "node 1" not in late.line() and "sysctl -w net.ipv4.tcp_retries2=10` on each node (at least 325 s" in \
        late.line()
    assert partition_check([{"node": 0, "tcp_retries2": 10}]).status == "ok"  # the advised value passes
    unknown = partition_check([{"node": 0, "tcp_retries2": None}, {"node": 1, "tcp_retries2": None}])
    assert unknown.status == "ok" and "cannot be read" in unknown.line()


def test_the_workers_timeout_line_says_how_long_the_agent_waits_only_where_it_outlasts_it() -> None:
    assert agent_wait(300, retries=8) == ""
    said = agent_wait(300, retries=15)
    assert said == ("this node's net.ipv4.tcp_retries2 is 15: if it is cut off from the rendezvous host, torchrun's "
                    "agent here waits at least 925 s for TCP to give up; `sysctl -w net.ipv4.tcp_retries2=10` on each "
                    "node makes that at least 325 s")
    assert agent_wait(10, retries=6).endswith("is 6: if it is cut off from the rendezvous host, torchrun's agent here "
                                              "waits at least 25 s for TCP to give up; `sysctl -w "
                                              "net.ipv4.tcp_retries2=5` on each node makes that at least 13 s")
    assert agent_wait(10, retries=5) == agent_wait(10, retries=2) == ""  # the advised value, or sooner
    # past the doublings each retransmission adds 120 s: the value that outlasts an hour is above the default
    assert [fitting(t) for t in (0.1, 10, 300, 924.6, 925, 3600)] == [1, 5, 10, 15, 16, 38]
    assert all(give_up_s(fitting(t)) >= t > give_up_s(fitting(t) - 1) for t in (1, 10, 300, 3600))


def test_a_link_file_is_read_back_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    report = {"collectives": _sweep(_rows(5e9, 20e-6)), "devices": {"workers": 2, "backend": "gloo"}}
    path = doctor.write_link(report, tmp_path)
    name, bandwidth, latency = read_link(str(path))
    assert "measured by paratrain doctor" in name and bandwidth == pytest.approx(5e9) and latency > 0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="cannot read the link file .*; write one with `paratrain doctor --out DIR`"):
        read_link(str(tmp_path / "bad.json"))
    from paratrain.cli.plan import _link
    from paratrain.measure import scaling as plan

    args = argparse.Namespace(bandwidth_gbs=None, latency_us=None, link=str(path))
    assert _link(args, plan)[1:] == (bandwidth, latency)


def test_gloo_on_the_loopback_interface_across_nodes_is_a_failed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes under torchrun, gloo and no GLOO_SOCKET_IFNAME, a hostname that resolves to 127.x: the
    other node could not reach this one, so the doctor says so instead of hanging in the rendezvous."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(doctor, "_loopback_host", lambda: True)
    report = doctor.examine_group(timeout_s=5)
    (check,) = report["checks"]
    assert not report["passed"] and check["status"] == "failed"
    assert "gloo picked the loopback interface" in Check(**check).line() and "set GLOO_SOCKET_IFNAME" in \
        Check(**check).line()


def test_doctor_flag_errors(capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli import main

    for args, message in ((["--devices", "two"], "--devices must be auto or a number of devices of at least 1, not "
                                                "'two'"),
                          (["--devices", "0"], "of at least 1, not '0'"),
                          (["--timeout", "0"], "--timeout must be a number of seconds above 0")):
        assert main(["doctor", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.integration
def test_doctor_on_two_cpu_workers_passes_and_writes_its_report(tmp_path: Path) -> None:
    proc = run_cli("doctor", "--devices", "2", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--devices auto =" in proc.stdout and "busbw GB/s" in proc.stdout
    assert "doctor: every check passed" in proc.stdout
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert set(report) >= {"nodes", "devices", "collectives", "equivalence", "checks", "passed"}
    assert set(report["nodes"][0]) >= {"host", "versions", "cpu", "gpus", "peer_access", "auto_devices"}
    assert set(report["nodes"][0]["versions"]) == {"torch", "cuda", "cudnn", "nccl"}
    rows = report["collectives"]["rows"]
    assert rows[0]["bytes"] == 4 and all(r["wrong"] == 0 for r in rows) and len(rows) >= 8
    assert {"bandwidth", "latency"} == set(report["collectives"]["fit"])
    assert [(e["task"], e["strategy"]) for e in report["equivalence"]] == [
        ("images", "ddp"), ("images", "tower"), ("images", "pipeline"), ("token ids", "ddp")]
    assert all(e["ok"] and e["max_abs_diff"] < 1e-4 for e in report["equivalence"])
    assert read_link(str(tmp_path / "link.json"))[1] == report["collectives"]["fit"]["bandwidth"]


@pytest.mark.integration
@pytest.mark.parametrize(("fault", "line"), [("wrong-sum", "wrong elements on 2 gloo workers"),
                                             ("hang", "gloo all-reduce failed between the 2 gloo workers")])
def test_a_failing_collective_is_a_failed_check_and_a_non_zero_exit(monkeypatch: pytest.MonkeyPatch, fault: str,
                                                                     line: str) -> None:
    monkeypatch.setenv("PARATRAIN_DOCTOR_FAULT", fault)  # test-only: the last worker adds 1, or never joins
    proc = run_cli("doctor", "--devices", "2", "--skip-training", "--timeout", "3", timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [x for x in proc.stdout.splitlines() if x.startswith("failed")]
    assert len(failed) == 1 and line in failed[0], proc.stdout
    # the other check, the matrix multiply a language model's mfu is measured against, passes
    assert "doctor: 1 of 2 checks failed" in proc.stdout and any(x.startswith("ok     matmul") for x in
                                                                  proc.stdout.splitlines()), proc.stdout


def test_the_gpu_acceptance_script_refuses_a_host_without_a_gpu(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = Path(__file__).parent.parent / "benchmarks" / "gpu_acceptance.sh"
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})  # conftest hides any GPU of this machine
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gpu_acceptance: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it on a machine with "
        "GPUs"]
    assert not (tmp_path / "out").exists()


def test_nvlink_is_named_only_where_every_pair_of_gpus_has_it() -> None:
    from paratrain.measure.doctor.inventory import nvlinked

    full = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV12\tNV12\t0-63\nGPU1\tNV12\t X \tNV12\t0-63\n"
            "GPU2\tNV12\tNV12\t X \t0-63\n")
    assert nvlinked(full, 3) and nvlinked(full, 2)
    bridged = full.replace("GPU2\tNV12\tNV12", "GPU2\tSYS\tNV12")
    bridged = bridged.replace("GPU0\t X \tNV12\tNV12", "GPU0\t X \tNV12\tSYS")
    assert nvlinked(bridged, 2) and not nvlinked(bridged, 3)  # a ring over GPU 0..2 crosses the host
    assert not nvlinked("", 2)
