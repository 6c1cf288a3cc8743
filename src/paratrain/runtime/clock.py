"""Where a run's time goes before its first step and after its last (summary.json's `startup_s`, `finish_s`).

Marks are wall-clock times (time.time(), comparable between the processes of one machine), kept in a dict
that travels with the run's plan: the launcher marks the data read and the launch, each worker what it
does before training (joining the group, building its model), and rank 0's Trainer the rest.

    imports     the process's start to paratrain's train (Python, torch, the command line; a script's own work)
    data        reading the data (decoding, or a cache opened)
    plan        the checks before any worker starts, config.yaml
    spawn       the launch to a spawned worker's first line (its Python, its imports, the plan unpickled)
    join        the process group's rendezvous (waits for the slowest worker to arrive)
    build       the model, optimizer, schedule, run log and TensorBoard writer
    first_step  the first step (it allocates every buffer)
"""

from __future__ import annotations

import os
import time

STARTUP = ("imports", "data", "plan", "spawn", "join", "build", "first_step")
FINISH = ("evaluation", "checkpoint", "logs", "shutdown")

# when this module was first imported: the stand-in for the process's start where /proc cannot say
_IMPORTED = time.time()


def process_start() -> float:
    """When this process started (Linux: from /proc, to the kernel's 10 ms tick); elsewhere, when paratrain
    was first imported."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks after boot
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def startup(marks: dict[str, float]) -> dict[str, float | None]:
    """Seconds in each start-up phase, from the marks a run made (a phase whose marks are missing: None)."""

    def between(a: str, b: str) -> float | None:
        return max(0.0, marks[b] - marks[a]) if a in marks and b in marks else None

    data = marks.get("data_s")
    plan = between("train_called", "launched")
    return {"imports": between("process_start", "train_called"), "data": data,
            "plan": plan - data if plan is not None and data is not None else plan,
            "spawn": between("launched", "worker_entered"), "join": between("worker_entered", "joined"),
            "build": between("joined", "built"), "first_step": between("built", "first_step_done")}


def first_step_at(marks: dict[str, float]) -> float | None:
    """Seconds from the process's start to the start of the first training step."""
    if "process_start" in marks and "built" in marks:
        return marks["built"] - marks["process_start"]
    return None


def table(summary: dict) -> str:
    """The start-up and finish phases as lines for the console (--time-phases)."""
    rows = [(name, (summary.get("startup_s") or {}).get(name)) for name in STARTUP]
    rows += [(name, (summary.get("finish_s") or {}).get(name)) for name in FINISH]
    lines = ["phase        seconds"]
    lines += [f"{name:<12} {'-' if s is None else f'{s:7.2f}'}" for name, s in rows]
    at = summary.get("first_step_at_s")
    if at is not None:
        lines.append(f"the first step started {at:.2f} s after the process did; training took "
                     f"{summary.get('train_time_s', 0.0):.2f} s")
    return "\n".join(lines)
