"""What sharding saves: the model state each worker holds under ddp and fsdp, and the largest network each can
train within a memory limit per worker (issue 37).

    python benchmarks/fsdp_memory.py [--width 4096] [--limit-gb 2] [--only bytes|largest] [--layouts ddp:2,...]

bytes    An MLP of --width on synthetic 28 x 28 images (depth 3: 784 -> W -> W -> W -> 10; 37.6M weights at
         4096), Adam, a few steps, as ddp on 1 and 2 workers, fsdp on 2 and 4, a 2-stage pipeline: summary.json's
         model_state_bytes (parameters, gradients, optimizer state) of the largest worker and its peak RSS,
         and the state's ratio to ddp's on as many workers.
largest  Each worker in a memory cgroup of its own (--limit-gb; cgroup v1 or v2, as root), a binary search
         over the MLP's width for the widest that trains 3 steps and saves, for ddp on 2 workers, fsdp
         on 2 and 4 and a 2-stage pipeline (--layouts). A worker over its limit is killed by the kernel (exit
         137), or thrashes until the trial's time is up: that is what "does not fit" means here.
Each run is `paratrain train` in a fresh process, one at a time, 1 thread a worker (4 workers on 2 cores are
oversubscribed: memory, not speed, is measured). Prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1e6
TRIAL_S = 180  # a run of 3 steps that has not ended by then is stuck at its limit


def train_flags(width: int, depth: int, steps: int) -> list[str]:
    return ["--model", "mlp", "--width", str(width), "--depth", str(depth), "--dataset", "synthetic",
            "--batch-size", "64", "--steps", str(steps), "--eval-batch-size", "256", "--threads-per-worker", "1",
            "--no-tensorboard", "--quiet", "--log-every", "1"]


LAYOUTS = {"ddp:1": ["--devices", "1"], "ddp:2": ["--devices", "2"],
           "fsdp:2": ["--strategy", "fsdp", "--devices", "2"],
           "fsdp:4": ["--strategy", "fsdp", "--devices", "4", "--oversubscribe"],
           "pipeline:2": ["--strategy", "pipeline", "--stages", "2", "--devices", "2"]}


def command(out: Path, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "paratrain", "train", "--out", str(out), *flags]


def held_bytes(width: int, scratch: Path) -> None:
    print(f"\nmodel state per worker, MLP width {width}, depth 3, Adam (bytes of the largest worker)")
    print(f"{'layout':<11}{'weights':>12}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}{'total MB':>10}"
          f"{'x ddp':>7}{'peak RSS MB':>13}")
    ddp_total: dict[int, float] = {}
    for name, layout in LAYOUTS.items():
        out = scratch / name.replace(":", "-")
        proc = subprocess.run(command(out, [*train_flags(width, 3, 3), *layout]), capture_output=True, text=True)
        if proc.returncode:
            print(f"{name:<11} failed: {proc.stderr.strip().splitlines()[-1][:200]}")
            continue
        summary = json.loads((out / "summary.json").read_text())
        worst = max(summary["model_state_bytes"], key=lambda w: w["total"])
        workers = summary["world_size"]
        if name.startswith("ddp"):
            ddp_total[workers] = worst["total"]
        ratio = worst["total"] / ddp_total.get(workers, ddp_total.get(1, worst["total"]))
        weights = sum(w["parameters"] for w in summary["model_state_bytes"]) // 4 // (workers if
                                                                                     name.startswith("ddp") else 1)
        print(f"{name:<11}{weights:>12,}{worst['parameters'] / MB:>11.1f}{worst['gradients'] / MB:>10.1f}"
              f"{worst['optimizer'] / MB:>10.1f}{worst['total'] / MB:>10.1f}{ratio:>7.2f}"
              f"{max(summary['peak_memory_bytes']) / MB:>13.0f}")
        shutil.rmtree(out, ignore_errors=True)


# ---- each worker in a memory cgroup of its own ----

class Cgroups:
    """Memory cgroups under this benchmark's own folder of the hierarchy (v2, or v1's memory controller)."""

    def __init__(self, limit: int) -> None:
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
        if (v2 / "cgroup.controllers").is_file() and "memory" in (v2 / "cgroup.controllers").read_text():
            self.root, self.limit_file = v2 / f"paratrain-bench-{os.getpid()}", "memory.max"
        elif v1.is_dir():
            self.root, self.limit_file = v1 / f"paratrain-bench-{os.getpid()}", "memory.limit_in_bytes"
        else:
            raise OSError("no memory cgroup hierarchy at /sys/fs/cgroup")
        self.root.mkdir()
        if self.limit_file == "memory.max":
            (self.root / "cgroup.subtree_control").write_text("+memory")
        self.limit, self.made = limit, 0

    def confine(self, pid: int) -> None:
        """Move `pid` into a new cgroup of `limit` bytes (its memory charged there from now; v1 moves what
        it already holds with it)."""
        self.made += 1
        group = self.root / f"w{self.made}"
        group.mkdir()
        try:
            (group / self.limit_file).write_text(str(self.limit))
            if self.limit_file == "memory.limit_in_bytes":
                (group / "memory.memsw.limit_in_bytes").write_text(str(self.limit))  # no escape into swap
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:
            group.rmdir()
            raise

    def close(self) -> None:
        for group in sorted(self.root.glob("w*")):
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self.root.rmdir()


def _children() -> dict[int, int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    return {p: pp for p, pp in (map(int, line.split()) for line in out.splitlines())}


def _workers(launcher: int) -> list[int]:
    """The launcher's training workers: forked from its forkserver (paratrain's default) or spawned."""
    parent = _children()
    mine, frontier = set(), {launcher}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - mine
        mine |= frontier

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    servers = {p for p in mine if parent.get(p) == launcher and b"forkserver" in cmdline(p)}
    return sorted(p for p in mine if b"spawn_main" in cmdline(p) or parent.get(p) in servers)


def fits(width: int, layout: list[str], workers: int, groups: Cgroups, scratch: Path) -> bool:
    """Whether the MLP of `width` trains 3 steps and saves with each worker under the limit."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    proc = subprocess.Popen(command(out, [*train_flags(width, 4, 3), *layout, "--max-restarts", "0"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    confined: set[int] = set()
    if workers == 1:  # one worker trains in the launcher's own process
        groups.confine(proc.pid)
        confined.add(proc.pid)
    deadline = time.monotonic() + TRIAL_S
    while proc.poll() is None and time.monotonic() < deadline:
        if workers > 1:  # a worker is forked with torch loaded, and builds its model a second later: caught first
            for pid in set(_workers(proc.pid)) - confined:
                confined.add(pid)
                try:
                    groups.confine(pid)
                except OSError:  # gone already
                    pass
        time.sleep(0.01)
    if proc.poll() is None:  # thrashing at its limit rather than killed: it does not fit either
        proc.kill()
        proc.wait()
    ok = proc.returncode == 0 and (out / "summary.json").is_file()
    print(f"  width {width}: {'fits' if ok else 'does not fit'}", file=sys.stderr, flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return ok


def largest(limit_gb: float, scratch: Path, layouts: list[str]) -> None:
    limit = int(limit_gb * 2**30)
    try:
        groups = Cgroups(limit)
    except OSError as e:
        print(f"\nlargest network: skipped, no memory cgroup can be made here ({e}); run as root on Linux")
        return
    print(f"\nthe widest MLP (depth 4: 784 -> W x4 -> 10, Adam) that trains with each worker in a {limit_gb:g} GiB "
          "memory cgroup")
    print(f"{'layout':<11}{'width':>8}{'weights':>14}{'state/worker MB':>17}{'next width (fails)':>20}")
    try:
        for name in layouts:
            workers = int(name.split(":")[1])
            low, high = 1024, 2048  # fits, and the first width that does not
            while fits(high, LAYOUTS[name], workers, groups, scratch):
                low, high = high, high * 2
            while high - low > 256:
                mid = (low + high) // 2 // 128 * 128
                low, high = (mid, high) if fits(mid, LAYOUTS[name], workers, groups, scratch) else (low, mid)
            weights = 784 * low + low + 3 * (low * low + low) + low * 10 + 10
            per_worker = weights * 16 / (1 if name.startswith("ddp") else workers)  # a stage: about 1/K
            print(f"{name:<11}{low:>8}{weights:>14,}{per_worker / MB:>17.0f}{high:>20}", flush=True)
    finally:
        groups.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--limit-gb", type=float, default=2.0)
    parser.add_argument("--only", choices=("bytes", "largest"))
    parser.add_argument("--layouts", default="ddp:2,fsdp:2,fsdp:4,pipeline:2", help=f"largest: of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.only in (None, "bytes"):
            held_bytes(args.width, Path(scratch))
        if args.only in (None, "largest"):
            largest(args.limit_gb, Path(scratch), args.layouts.split(","))


if __name__ == "__main__":
    main()
