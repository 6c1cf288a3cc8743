"""`paratrain devices`: the CPU, the GPUs, the backend, and what --devices auto means here."""

from __future__ import annotations

import argparse
import json


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="show the CPU, GPUs, backend, and what --devices auto means")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..runtime import devices

    info = devices.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cpu = info["cpu"]
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, {cpu['memory_gib']} GiB")
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability {g['compute_capability']}")
    if not info["gpus"]:
        print("GPUs: none visible to CUDA")
    # on CPUs that is the most workers a run considers: a long enough run measures 1, 2, 4.. and takes the fastest
    measured = " at most (a run measures fewer against it, and trains on the fastest)" \
        if info["auto_accelerator"] == "cpu" and info["auto_devices"] > 1 else ""
    print(f"backend: {info['backend']}; --devices auto = {info['auto_devices']} {info['auto_accelerator']} "
          f"worker(s) x {info['threads_per_worker']} thread(s){measured}; torch {info['torch_version']}")
    return 0
