"""What hardware is here, and how a run maps onto it (backend, workers, threads)."""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import asdict, dataclass

import torch

from ..core.errors import UserError
from .env import Environment

# Past a handful of CPU workers, gloo's all-reduce and a dataset copy per process cost more than
# the extra processes gain; the remaining cores go to intra-op threads instead.
MAX_AUTO_CPU_WORKERS = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (None where there is no such file: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def describe() -> dict:
    """CPU, GPUs, backend and what `--devices auto` means here (for `paratrain devices`)."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                     "compute_capability": f"{p.major}.{p.minor}"})
    plan = resolve("auto", "auto", None)
    return {
        "cpu": {"model": cpu_model(), "cores": usable_cores(), "memory_gib": _memory_gib()},
        "gpus": gpus,
        "backend": plan.backend,
        "auto_devices": plan.workers,
        "auto_accelerator": plan.accelerator,
        "threads_per_worker": plan.threads_per_worker,
        "torch_version": torch.__version__,
    }


@dataclass(frozen=True)
class Hardware:
    accelerator: str  # "cpu" or "gpu"
    workers: int
    threads_per_worker: int
    backend: str  # "gloo" or "nccl"

    def to_dict(self) -> dict:
        return asdict(self)


MAX_OVERSUBSCRIPTION = 4  # --oversubscribe: CPU workers a core, at most


def resolve(accelerator: str, devices: str, threads_per_worker: int | None, oversubscribe: bool = False) -> Hardware:
    """Turn --accelerator/--devices/--threads-per-worker into a concrete plan, or a UserError.
    `oversubscribe` lets CPU workers outnumber the cores (one thread each): slow, but it runs."""
    n_gpus = torch.cuda.device_count()
    cores = usable_cores()
    if accelerator == "auto":
        accelerator = "gpu" if n_gpus else "cpu"
    if accelerator == "gpu" and n_gpus == 0:
        raise UserError("--accelerator gpu was asked for but no CUDA GPU is visible; use --accelerator cpu")
    if accelerator == "gpu":
        workers = n_gpus if devices == "auto" else int(devices)
        if workers > n_gpus:
            raise UserError(f"--devices {workers} asks for more GPUs than the {n_gpus} here; "
                            f"use --devices {n_gpus} or fewer")
        # GPU workers need few CPU threads; share the cores without oversubscribing them.
        threads = threads_per_worker or max(1, cores // workers)
        return Hardware("gpu", workers, threads, "nccl")
    workers = min(cores, MAX_AUTO_CPU_WORKERS) if devices == "auto" else int(devices)
    if oversubscribe and workers > cores:
        if workers > MAX_OVERSUBSCRIPTION * cores:  # thousands of processes would hang the machine
            raise UserError(f"--devices {workers} --oversubscribe: at most {MAX_OVERSUBSCRIPTION} workers a core "
                            f"({MAX_OVERSUBSCRIPTION * cores} here); use --devices {MAX_OVERSUBSCRIPTION * cores} "
                            "or fewer")
        return Hardware("cpu", workers, 1, "gloo")
    check_workers("cpu", workers, oversubscribe, f"--devices {workers}", f"use --devices {cores} or fewer")
    threads = threads_per_worker or max(1, cores // workers)
    if workers * threads > cores:
        raise UserError(f"{workers} workers x {threads} threads exceed the {cores} cores here; "
                        f"lower --threads-per-worker to {max(1, cores // workers)}")
    return Hardware("cpu", workers, threads, "gloo")


def check_workers(accelerator: str, workers: int, oversubscribe: bool, asked: str, fix: str) -> None:
    """One line where `asked` (the flag that set the count, as the user gave it) wants more CPU workers than the
    cores and no --oversubscribe; `fix`: what to give instead. Nothing where the workers are GPUs."""
    if oversubscribe or accelerator == "gpu" or (accelerator == "auto" and torch.cuda.device_count()):
        return
    cores = usable_cores()
    if workers > cores:
        raise UserError(f"{asked} asks for more CPU workers than the {cores} cores here (it would oversubscribe "
                        f"them); {fix.format(cores=cores)}, or --oversubscribe")


def for_group(env: Environment, accelerator: str, threads_per_worker: int | None, devices: str = "auto") -> Hardware:
    """The processes a launcher's group imposes (torchrun's, or srun's tasks): its world size, and this node's
    cores shared by its local workers. `devices`: --devices, which must agree with the group where it is set."""
    n_gpus = torch.cuda.device_count()
    who = "srun" if env.launcher == "slurm" else "torchrun"
    if devices != "auto" and int(devices) != env.world_size:
        how = "--ntasks" if env.launcher == "slurm" else "--nnodes x --nproc-per-node"
        raise UserError(f"{who} started {env.world_size} workers but --devices is {devices}: under {who} every "
                        f"{'task' if env.launcher == 'slurm' else 'process'} is one worker; leave out --devices or "
                        f"start {devices} with {how}")
    if accelerator == "auto":
        accelerator = "gpu" if n_gpus else "cpu"
    if accelerator == "gpu" and env.local_rank >= n_gpus and not _own_gpu(env, n_gpus):
        fix = "--ntasks-per-node" if env.launcher == "slurm" else "--nproc-per-node"
        raise UserError(f"{who} started {env.local_world_size} workers on this node but it has {n_gpus} GPU(s); "
                        f"use {fix} {n_gpus} or --accelerator cpu")
    # srun --cpus-per-task binds a task to its cores where the cluster binds (task/affinity): never more threads
    threads = threads_per_worker or (min(env.cpus_per_task, usable_cores()) if env.cpus_per_task else
                                     max(1, usable_cores() // env.local_world_size))
    return Hardware(accelerator, env.world_size, threads, "nccl" if accelerator == "gpu" else "gloo")


def _own_gpu(env: Environment, n_gpus: int) -> bool:
    """srun gave each task a GPU of its own (--gpus-per-task=1: each sees just its own, as device 0). torchrun's
    processes all see the machine's GPUs, so one visible GPU for several of them is a mistake, not this."""
    return env.launcher == "slurm" and n_gpus == 1


def group_devices(env: Environment, hardware: Hardware) -> tuple[str, ...]:
    """This node's workers' devices, by local rank, in a launcher's group: a GPU each, or the one GPU each task
    sees where srun gave each its own."""
    if hardware.accelerator == "gpu" and _own_gpu(env, torch.cuda.device_count()):
        return ("cuda:0",) * env.local_world_size
    return device_map(dataclasses.replace(hardware, workers=env.local_world_size))


def device_map(hardware: Hardware, first: int = 0) -> tuple[str, ...]:
    """Each worker's device: a GPU each from `first` on, or the CPU."""
    if hardware.accelerator == "gpu":
        return tuple(f"cuda:{first + i}" for i in range(hardware.workers))
    return ("cpu",) * hardware.workers


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


FLOAT8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (L4, RTX 40xx) and Hopper (H100) onwards
TF32_CAPABILITY = (8, 0)  # TF32 tensor cores: Ampere (A100) onwards


def check_float8(hardware: Hardware) -> None:
    """--precision float8 runs torchao's float8 matrix products, which need float8 tensor cores on every GPU of
    the run; a UserError naming what this machine has where it lacks them."""
    from ..core.optional import require

    if hardware.accelerator != "gpu":
        raise UserError("--precision float8 needs GPUs of compute capability 8.9 or later (L4, RTX 40xx, H100), and "
                        "this run is on CPUs; use --precision bf16 or 32")
    for i in range(min(hardware.workers, torch.cuda.device_count())):  # this node's, of those this process sees
        p = torch.cuda.get_device_properties(i)
        if (p.major, p.minor) < FLOAT8_CAPABILITY:
            raise UserError(f"--precision float8 needs GPUs of compute capability 8.9 or later, and GPU {i} ({p.name}) "
                            f"has {p.major}.{p.minor}; use --precision bf16")
    require("torchao", "--precision float8")


# what a CPU computes for a GPU's precision: float16 has no fast CPU kernels (a ResNet-18 ran 86x slower under
# 16-mixed than in float32), so bf16 takes its place, as Lightning does; tf32 is a format of NVIDIA's tensor
# cores, so float32, which the CPU would compute anyway
ON_CPU = {"16-mixed": "bf16", "tf32": "32"}
_ON_CPU_NOTES = {
    "16-mixed": "--precision 16-mixed (float16) has no fast kernels on CPUs and ran ~86x slower than float32 here; "
                "this run uses bf16 (bfloat16 autocast) instead; --precision 32 is the usual choice on a CPU",
    "tf32": "--precision tf32 is a format of NVIDIA GPUs' tensor cores (Ampere or later); this run computes in "
            "float32",
}


def precision_on(precision: str, hardware: Hardware) -> tuple[str, str | None]:
    """The precision a run can use on its devices, and a note where it is not the one asked for (or is slow
    there); a UserError where the devices lack it. On CPUs, ON_CPU's; on a GPU before Ampere, tf32 is float32,
    which it would compute anyway."""
    if precision == "float8":
        check_float8(hardware)
        return precision, None
    if hardware.accelerator == "cpu" and precision in ON_CPU:
        return ON_CPU[precision], _ON_CPU_NOTES[precision]
    if precision == "tf32" and torch.cuda.get_device_capability(0) < TF32_CAPABILITY:
        return "32", (f"--precision tf32: {torch.cuda.get_device_name(0)} has no TF32 tensor cores (Ampere or later "
                      "have them); this run computes in float32")
    if hardware.accelerator == "cpu":
        flags = cpu_flags()
        if precision == "bf16" and flags and not flags & {"avx512_bf16", "amx_bf16"} and platform.machine() in (
                "x86_64", "AMD64"):
            return precision, ("this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16): --precision bf16 is "
                               "emulated here and may run slower than --precision 32")
        return precision, None
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UserError(f"--precision bf16: {torch.cuda.get_device_name(0)} has no bfloat16 support; use "
                        "--precision 16-mixed or 32")
    return precision, None
