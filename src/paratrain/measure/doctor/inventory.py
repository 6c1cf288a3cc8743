"""What `paratrain doctor` reports first (what `python -m torch.utils.collect_env` and `accelerate env`
report): versions, each GPU, which GPU pairs reach each other directly and over what link, the cores, and
what `--devices auto` picks."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from typing import Any

import torch

from ...runtime.tcp_timeout import tcp_retries2

# Bus bandwidth an all-reduce reaches on a link that is working, bytes/s: half of it is "slow". Round
# figures from NVIDIA's published nccl-tests results, for the GPUs whose NVLink they name (by compute
# capability: H100, A100, V100; other cards' bridges differ too much to guess); a PCIe link's by its
# generation (x16, through the host).
NVLINK_BUSBW = {(9, 0): 370e9, (8, 0): 230e9, (7, 0): 130e9}
PCIE_BUSBW = {3: 10e9, 4: 20e9, 5: 40e9}


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": None,
                                    "nccl": None}
    if torch.backends.cudnn.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    try:
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 (a build without NCCL)
        pass
    return found


def peer_pairs(count: int) -> list[list[int]]:
    """GPU pairs (i, j) where i reads j's memory directly (CUDA peer access)."""
    return [[i, j] for i in range(count) for j in range(count) if i != j and torch.cuda.can_device_access_peer(i, j)]


def _nvidia_smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def nvlinked(topology: str, count: int) -> bool:
    """Whether `nvidia-smi topo -m` joins every pair of the first `count` GPUs by NVLink (NV<k>); a ring
    over a node where only some pairs are bridged crosses PCIe."""
    rows = {}
    for line in topology.splitlines():
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[int(cells[0][3:])] = cells[1:]
    if len(rows) < count:
        return False
    return all(re.fullmatch(r"NV\d+", rows[i][j]) for i in range(count) for j in range(count)
               if i != j and j < len(rows[i]))


def link(gpus: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The link between the GPUs as the hardware names it (NVLink, or the PCIe generation), and the bus
    bandwidth it should reach; None where there is no pair of GPUs, or the driver does not say, or the card
    is not one whose link speed is known."""
    if len(gpus) < 2:
        return None
    capability = tuple(int(x) for x in gpus[0]["compute_capability"].split("."))
    if nvlinked(_nvidia_smi("topo", "-m") or "", len(gpus)):
        peak = NVLINK_BUSBW.get(capability)
        return {"kind": "NVLink", "peak_busbw": peak} if peak else None
    generation = (_nvidia_smi("--query-gpu=pcie.link.gen.max", "--format=csv,noheader") or "").split()
    if generation and generation[0].isdigit() and int(generation[0]) in PCIE_BUSBW:
        return {"kind": f"PCIe gen {generation[0]}", "peak_busbw": PCIE_BUSBW[int(generation[0])]}
    return None


def inventory(node: int = 0) -> dict[str, Any]:
    """This machine's devices, versions and settings; `node`: its rank among a launcher's nodes."""
    from ...runtime.devices import describe

    info = describe()
    info["host"] = socket.gethostname()
    info["node"] = node  # hosts may share a name
    info["versions"] = versions()
    info["cpu"]["threads"] = torch.get_num_threads()
    info["peer_access"] = peer_pairs(len(info["gpus"]))
    info["gpu_link"] = link(info["gpus"])
    info["tcp_retries2"] = tcp_retries2()  # how long a partition keeps torchrun's agent here (partition_check)
    return info


def described(info: dict[str, Any]) -> list[str]:
    """The inventory in lines."""
    v, cpu = info["versions"], info["cpu"]
    lines = [f"node {info['node']} ({info['host']}): torch {v['torch']}, CUDA {v['cuda'] or '-'}, "
             f"cuDNN {v['cudnn'] or '-'}, NCCL {v['nccl'] or '-'}",
             f"  CPU: {cpu['model']}, {cpu['cores']} cores, {cpu['threads']} torch threads, {cpu['memory_gib']} GiB"]
    for g in info["gpus"]:
        lines.append(f"  GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability "
                     f"{g['compute_capability']}")
    if not info["gpus"]:
        lines.append("  GPUs: none visible to CUDA")
    elif len(info["gpus"]) > 1:
        pairs = len(info["peer_access"])
        total = len(info["gpus"]) * (len(info["gpus"]) - 1)
        through = f", {info['gpu_link']['kind']}" if info["gpu_link"] else ""
        lines.append(f"  peer access: {pairs} of {total} GPU pairs{through}")
    lines.append(f"  --devices auto = {info['auto_devices']} {info['auto_accelerator']} worker(s) x "
                 f"{info['threads_per_worker']} thread(s), backend {info['backend']}")
    return lines
