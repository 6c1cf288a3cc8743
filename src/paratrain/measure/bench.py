"""`paratrain bench`: the same training in several configurations (--configs, or a first look at the machine),
measured side by side.

Each configuration runs as `paratrain train` in a process of its own (never two at once), `--repeats` times,
plus one short run with --time-phases for the step-time breakdown. A configuration that fails is
recorded with its error and the others still run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..config import TrainConfig
from ..core.errors import UserError
from ..core.run_paths import RunPaths
from ..parallel import strategies
from ..runtime import devices
from ..runtime.proc import user_malloc

_SPEC = re.compile(r"^(cpu|ddp-cpu|gpu|tower-cpu|tower-gpu|fsdp-cpu|fsdp-gpu|tp-cpu|tp-gpu):(\d+)(t?)$")
_MESH_SPEC = re.compile(r"^mesh-(cpu|gpu):(.+)$")  # mesh-cpu:fsdp=2,tp=2 (its commas are the mesh's)
_PIPE_SPEC = re.compile(r"^(pipeline|hybrid)-(cpu|gpu):(\d+)x(\d+)$")


@dataclass(frozen=True)
class BenchConfig:
    name: str  # as written: cpu:2t, ddp-cpu:2, gpu:4, tower-gpu:2, pipeline-cpu:2x4, hybrid-gpu:2x2
    family: str  # cpu, ddp-cpu, gpu, tower-cpu, ...: the configurations one scaling line joins
    devices: int  # devices (processes or towers) it uses (1 for the cpu:Kt rows)
    flags: tuple[str, ...]  # the `paratrain train` flags that make it
    strategy: str = "ddp"  # the strategy that runs it (a mesh's, resolved): what its layout can time


def parse_configs(spec: str) -> list[BenchConfig]:
    """`cpu:1t,cpu:2t,ddp-cpu:2,gpu:1,gpu:2,tower-gpu:2` -> configurations (a pure function)."""
    out = []
    for token in _tokens(spec):
        mm = _MESH_SPEC.match(token)
        if mm:
            out.append(_mesh_config(token, mm.group(1), mm.group(2)))
            continue
        pm = _PIPE_SPEC.match(token)
        if pm:
            out.append(_pipeline_config(token, pm.group(1), pm.group(2), int(pm.group(3)), int(pm.group(4))))
            continue
        m = _SPEC.match(token)
        if not m or (m.group(1) == "cpu") != (m.group(3) == "t") or int(m.group(2)) < 1:
            raise UserError(f"--configs: cannot read '{token}'; write cpu:Kt (one process, K threads), "
                            "ddp-cpu:N, gpu:N, tower-cpu:N, tower-gpu:N, fsdp-cpu:N, fsdp-gpu:N, pipeline-cpu:KxM "
                            "(K stages, M micro-batches), pipeline-gpu:KxM, hybrid-cpu:KxR (R copies of K stages), "
                            "tp-cpu:N, tp-gpu:N or mesh-cpu:fsdp=2,tp=2")
        kind, n = m.group(1), int(m.group(2))
        if kind == "cpu":
            flags = ("--accelerator", "cpu", "--devices", "1", "--threads-per-worker", str(n))
            out.append(BenchConfig(token, kind, 1, flags))
            continue
        accel = "gpu" if kind.endswith("gpu") else "cpu"
        flags = ("--accelerator", accel, "--devices", str(n))
        strategy = kind.rpartition("-")[0] or TrainConfig.strategy  # tower-gpu: tower; gpu: the default's
        if strategy != TrainConfig.strategy:
            flags += ("--strategy", strategy)
        out.append(BenchConfig(token, kind, n, flags, strategy))
    if not out:
        raise UserError("--configs is empty; name at least one configuration, e.g. ddp-cpu:1,ddp-cpu:2")
    return out


def _tokens(spec: str) -> list[str]:
    """The configurations of --configs: split at commas, a mesh's own `name=size` parts joined back to it."""
    tokens: list[str] = []
    for part in (t.strip() for t in spec.split(",") if t.strip()):
        if tokens and tokens[-1].startswith("mesh-") and re.fullmatch(r"\w+=\d+", part):
            tokens[-1] += "," + part
        else:
            tokens.append(part)
    return tokens


def _mesh_config(token: str, accel: str, text: str) -> BenchConfig:
    """mesh-cpu:fsdp=2,tp=2: the workers on that mesh (their count its product)."""
    from ..parallel.mesh import parse, strategy_for

    mesh = parse(text)
    return BenchConfig(token, f"mesh-{accel}", mesh.workers, ("--accelerator", accel, "--devices", str(mesh.workers),
                                                              "--mesh", mesh.text()), strategy_for(mesh)["strategy"])


def _pipeline_config(token: str, kind: str, accel: str, k: int, x: int) -> BenchConfig:
    """pipeline-cpu:2x4: 2 stages, 4 micro-batches. hybrid-cpu:2x2: 2 copies of a 2-stage pipeline (with
    2 micro-batches each, the least that overlaps anything)."""
    if k < 2 or x < 1:
        raise UserError(f"--configs: '{token}' needs 2 or more stages and at least 1 micro-batch or copy")
    workers, micro = (k, x) if kind == "pipeline" else (k * x, 2)
    flags = ("--accelerator", accel, "--devices", str(workers), "--strategy", kind, "--stages", str(k),
             "--microbatches", str(micro))
    return BenchConfig(token, f"{kind}-{accel}", workers, flags, kind)


def default_configs(cores: int, gpus: int) -> list[BenchConfig]:
    """The configurations of a first bench, a dozen rows at most on a node of 8 GPUs: the CPU with 1 thread and
    with all cores; where there is no GPU, gloo workers at each power of two up to the cores (and the cores);
    each GPU count with DDP; the tower beside DDP. A row a core count put ~100 CPU rows, each repeated, before
    the first GPU row of a 128-core GPU node."""
    names = ["cpu:1t"] + ([f"cpu:{cores}t"] if cores > 1 else [])
    if not gpus:
        counts = sorted({2 ** k for k in range(cores.bit_length())} | {cores})
        names += [f"ddp-cpu:{n}" for n in counts]
    names += [f"gpu:{n}" for n in range(1, gpus + 1)]
    names += [f"tower-gpu:{gpus}"] if gpus > 1 else ([f"tower-cpu:{cores}"] if cores > 1 and not gpus else [])
    return parse_configs(",".join(names))


def _read_run(run_dir: Path) -> dict[str, Any]:
    """A run directory's summary, epoch times and logged examples/sec windows."""
    summary = json.loads(RunPaths(run_dir).summary.read_text())
    records = [json.loads(line) for line in RunPaths(run_dir).metrics.read_text().splitlines() if line.strip()]
    return {"summary": summary,
            "epoch_times": [r["epoch_time_s"] for r in records if "epoch_time_s" in r],
            "window_rates": [r["examples_per_sec"] for r in records if "loss" in r],
            "window_tokens": [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]}


@dataclass(frozen=True)
class Runner:
    """How the bench runs `paratrain train ARGV`: in a process of its own, forked from paratrain's forkserver
    (torch imported: a fresh interpreter spent ~2.5 CPU-s importing before it trained, a quarter of a short
    bench), its output kept apart; stopped past `timeout` seconds, and with the bench (Ctrl-C, or killed: the
    forkserver ends, and the run with it). `command(argv, cwd, environ, streams)`: a function of the command
    line's (cli/bench.py's train_run) that runs it in the process it is called in, as if started afresh."""

    command: Callable[..., None]
    timeout: float = 3600

    def __call__(self, argv: list[str]) -> tuple[int, str, float]:
        """The run's exit code, its standard error (its standard output where that is empty), and its seconds
        from its start (the forkserver's imports, which the first run's start waits for, not counted)."""
        import multiprocessing
        import signal
        import tempfile

        from ..parallel.launch import stop_processes
        from ..runtime import prefork

        context = multiprocessing.get_context(prefork.start_method())
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = context.Process(target=self.command, args=(argv, os.getcwd(), dict(os.environ),
                                                                 prefork.Streams(out.fileno(), err.fileno())))
            try:
                process.start()
                t0 = time.perf_counter()
                process.join(self.timeout)
                if process.exitcode is None:
                    stop_processes([process], signal.SIGTERM)
                    raise subprocess.TimeoutExpired(["paratrain", *argv], self.timeout)
            except BaseException:  # Ctrl-C: the run stops at its step as a run of train's own does
                if process.pid is not None:
                    stop_processes([process], signal.SIGINT)
                raise
            seconds = time.perf_counter() - t0
            out.seek(0)
            err.seek(0)
            return process.exitcode, err.read() or out.read(), seconds


def _train(flags: list[str], out: Path, runner: Runner) -> dict[str, Any]:
    # the bench's own runs: a bench run again in its folder measures afresh
    argv = ["train", "--quiet", "--no-tensorboard", "--overwrite", "--out", str(out), *flags]
    try:
        code, output, wall = runner(argv)
    finally:  # a measurement's: its figures are in the files kept (a run stopped by Ctrl-C saved one too)
        shutil.rmtree(RunPaths(out).checkpoints, ignore_errors=True)
    if code:
        lines = output.strip().splitlines() or [f"exit code {code}"]
        raise RuntimeError(lines[-1][:300])
    return {**_read_run(out), "wall_s": wall}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def measure(config: BenchConfig, train_flags: list[str], repeats: int, out: Path, runner: Runner) -> dict:
    runs = [_train([*train_flags, *config.flags], out / "runs" / f"{config.name.replace(':', '-')}-r{i}", runner)
            for i in range(repeats)]
    # Warm-up excluded: the first logged window of each run holds start-up and first-touch costs.
    rates = [r for run in runs for r in (run["window_rates"][1:] or run["window_rates"])]
    tokens = [r for run in runs for r in (run["window_tokens"][1:] or run["window_tokens"])]  # a language model's
    epochs = [run["epoch_times"] for run in runs]
    steady = [t for times in epochs for t in (times[1:] or times)]
    # no --time-phases for a pipeline (the bubble is measured instead) nor fsdp (its collectives run inside the
    # forward and backward)
    layout = strategies.get(config.strategy)
    untimed = layout.pipelined or not layout.allreduce_timed or "--mesh" in config.flags
    phased = None if untimed else _train([*train_flags, *config.flags, "--time-phases", "--steps", "30",
                                            "--log-every", "10"],
                                           out / "runs" / f"{config.name.replace(':', '-')}-phases", runner)
    first = runs[0]["summary"]
    return {
        **asdict(config), "status": "ok", "repeats": repeats,
        "examples_per_sec": _stats(rates), **({"tokens_per_sec": _stats(tokens)} if tokens else {}),
        "epoch_time_s": _stats(steady), "epoch_times_s": epochs[0],
        "eval_time_s": _stats([run["summary"]["eval_time_s"] for run in runs]),
        "total_time_s": _stats([run["wall_s"] for run in runs]),
        # None where the task has no classes (a regression): its test loss says how well it learnt instead
        "test_accuracy": _stats([v for run in runs if (v := run["summary"]["test_accuracy"]) is not None]),
        "test_loss": _stats([v for run in runs if (v := run["summary"]["test_loss"]) is not None]),
        "step_phases_s": phased["summary"]["step_phases_s"] if phased else None,
        "pipeline": first.get("pipeline"),
        "world_size": first["world_size"], "global_batch_size": first["global_batch_size"],
        "oversubscribed": "cpu" in config.family and config.devices > devices.usable_cores(),
        "devices_used": first["devices"],
        # each worker's parameters, gradients and optimizer state (the largest), and its peak memory
        "model_state_bytes": max((w["total"] for w in first.get("model_state_bytes") or []), default=None),
        "peak_memory_bytes": max(first.get("peak_memory_bytes") or [], default=None),
        # and what its set-up and steps added to it (`paratrain plan`'s activations: beyond the state)
        "peak_memory_added_bytes": max(first.get("peak_memory_added_bytes") or [], default=None),
    }


def add_speedups(results: list[dict], cores: int | None = None) -> None:
    """Speed-up against the 1-device baseline (gpu:1 on GPU rows; on CPU rows the CPU as one device:
    ddp-cpu:1 or its twin cpu:Kt with every core, else cpu:1t) and scaling efficiency = speed-up / devices."""
    ok = {r["name"]: r for r in results if r["status"] == "ok"}
    cores = cores or devices.usable_cores()
    cpu_base = ok.get("ddp-cpu:1") or ok.get(f"cpu:{cores}t") or ok.get("cpu:1t")
    for r in results:
        if r["status"] != "ok":
            continue
        base = ok.get("gpu:1") if "gpu" in r["family"] else cpu_base
        if base is None:
            r["speedup"] = r["efficiency"] = None
            continue
        r["speedup"] = r["examples_per_sec"]["mean"] / base["examples_per_sec"]["mean"]
        r["efficiency"] = r["speedup"] / r["devices"]


def context() -> dict:
    info = devices.describe()
    return {"torch_version": torch.__version__, "cpu": info["cpu"], "gpus": info["gpus"],
            "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "malloc": user_malloc() or "glibc defaults + paratrain's mallopt"}


def result_from_run(run_dir: Path) -> dict:
    """A finished `paratrain train` run as one row of a report (for `paratrain report`)."""
    try:
        run = _read_run(run_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"{run_dir} is not a finished paratrain run ({e}); pass run directories") from None
    summary, epochs = run["summary"], run["epoch_times"]
    total = summary["train_time_s"] + (summary.get("eval_time_s") or 0.0)
    # one device is ddp's first point (mesh dp=1); a summary before 2026-11-29 named it 'single'
    family = {"single": "ddp"}.get(summary["strategy"], summary["strategy"])
    # a scaling curve joins runs of one workload only: two models at 2 devices are two curves, not a drop
    workload = _workload(run_dir, summary)
    family += f": {workload}"
    return {"name": run_dir.name, "family": family, "devices": summary["world_size"],
            # the run's own figure, as its summary and its last line give it
            "status": "ok", "repeats": 1, "examples_per_sec": _stats([summary["examples_per_sec"]] if
                                                                      summary.get("examples_per_sec") else []),
            "epoch_time_s": _stats(epochs[1:] or epochs), "epoch_times_s": epochs,
            "eval_time_s": _stats([summary.get("eval_time_s") or 0.0]), "total_time_s": _stats([total]),
            "test_accuracy": _stats([v] if (v := summary["test_accuracy"]) is not None else []),  # None: no classes
            "test_loss": _stats([v] if (v := summary.get("test_loss")) is not None else []),
            "step_phases_s": summary.get("step_phases_s"),
            "resumed_from_step": summary.get("resumed_from_step"), "workload": workload,
            "speedup": None, "efficiency": None}


# The options that change the network a run trains (beside its model's name), named where set away from their
# default: two MLPs of another width are two workloads.
SHAPING = ("width", "depth", "activation", "filters", "kernel", "dropout", "image_size")


def _workload(run_dir: Path, summary: dict[str, Any]) -> str:
    """What a run trains, and on which kind of device, in a few words: its model, dataset and global batch,
    the shaping options it set (from its config.yaml), and gpu where it ran on GPUs."""
    from ..config import FIELDS, load_yaml

    try:
        saved = load_yaml(RunPaths(run_dir).config)
    except UserError:  # a run without its config.yaml (copied without it): its summary's words alone
        saved = {}
    shaped = [f"{k} {saved[k]}" for k in SHAPING if saved.get(k) not in (None, FIELDS[k].default)]
    on_gpu = str((summary.get("devices") or ["cpu"])[0]).startswith("cuda")
    return ", ".join([f"{summary['model']} on {summary['dataset']}", *shaped,
                      f"batch {summary['global_batch_size']}", *(["gpu"] if on_gpu else [])])


def add_run_speedups(results: list[dict]) -> None:
    """`paratrain report`: speed-up against the first 1-device run of the same workload (any strategy), and
    efficiency = speed-up / devices; none where the workload has no 1-device run."""
    base: dict[str, float] = {}
    for r in results:
        rate = r["examples_per_sec"]["mean"] if r["status"] == "ok" else None
        if r["devices"] == 1 and rate:
            base.setdefault(r["workload"], rate)
    for r in results:
        rate = r["examples_per_sec"]["mean"] if r["status"] == "ok" else None
        if rate and r["workload"] in base:
            r["speedup"] = rate / base[r["workload"]]
            r["efficiency"] = r["speedup"] / r["devices"]


def _setup(config: BenchConfig) -> tuple:
    """What a configuration runs as, once resolved: ddp-cpu:1 is cpu:Kt with K = every core, for one."""
    flags = dict(zip(config.flags[::2], config.flags[1::2], strict=False))
    threads = int(flags.pop("--threads-per-worker")) if "--threads-per-worker" in flags else None
    try:
        plan = devices.resolve(flags.pop("--accelerator"), flags.pop("--devices"), threads)
    except UserError:  # measured anyway: the failure goes into the report
        return config.flags
    return plan, tuple(sorted(flags.items()))


def run_bench(configs: list[BenchConfig], train_flags: list[str], repeats: int, out: Path, runner: Runner,
              refused: Callable[[BenchConfig], str | None] | None = None) -> dict:
    """Measure each configuration (`refused`: why the workload cannot run on one, known before any run: it
    is reported failed without running)."""
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    measured: dict[tuple, dict] = {}  # resolved set-up -> its row: the same runs are never repeated
    for config in tqdm(configs, desc="bench", unit="config", disable=not sys.stderr.isatty()):
        why = refused(config) if refused is not None else None
        if why:
            results.append({**asdict(config), "status": "failed", "error": why})
            tqdm.write(f"bench: {config.name} left out: {why}")
            continue
        same = measured.get(_setup(config))
        if same is not None:
            results.append({**same, **asdict(config), "same_as": same["name"]})
            continue
        try:
            results.append(measure(config, train_flags, repeats, out, runner))
            measured[_setup(config)] = results[-1]
            if not sys.stderr.isatty():  # no bar: a line for each configuration measured
                tokens = results[-1].get("tokens_per_sec")
                rate = f"{tokens['mean']:,.0f} tokens/s" if tokens else \
                    f"{results[-1]['examples_per_sec']['mean']:,.0f} examples/s"
                print(f"bench: {config.name}: {rate} ({len(results)} of {len(configs)})", flush=True)
        # EOFError: the forkserver gone (a run's start reads its pid from it)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, EOFError, KeyError, ValueError) as e:
            results.append({**asdict(config), "status": "failed", "error": str(e).strip()})
            tqdm.write(f"bench: {config.name} failed: {e}")
    add_speedups(results)
    report = {"context": context(), "train_flags": train_flags, "repeats": repeats, "results": results}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
