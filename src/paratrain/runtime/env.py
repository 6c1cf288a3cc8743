"""The process environment: who started this process, and its place in the group. Read here, once per entry.

A run is started either on this machine (paratrain spawns its own workers: `local`) or by a launcher that
formed the group and started this process as one of its ranks: `torchrun` (its variables say the rank, the
world size, the local rank and the rendezvous) or Slurm's `srun` (a job step of two or more tasks, each task
one worker; the rendezvous is the step's first host at a port derived from the job id). Every question of the
kind "am I rank 0 / did a launcher start us / is this a Slurm job that can be requeued" is answered by an
`Environment`. This module imports no torch: the command line asks it before torch is loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# what srun gives each task of a step (the batch script's own shell has no SLURM_STEP_ID)
SRUN_VARS = ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")
# the rendezvous port of a Slurm step, unless MASTER_PORT says: in [PORT_BASE, PORT_BASE + PORT_SPAN), by job id,
# so that two jobs sharing a node rarely meet at one port (Lightning and submitit derive it the same way)
PORT_BASE, PORT_SPAN = 15000, 20000


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this process runs in (any of its steps, the batch script's included)."""

    job_id: str  # SLURM_JOB_ID (a task of a job array has its own)
    restart_count: int = 0  # SLURM_RESTART_COUNT: how often Slurm requeued and started the job again
    array_task: int | None = None  # SLURM_ARRAY_TASK_ID
    nodes: tuple[str, ...] = ()  # the job's nodes (SLURM_JOB_NODELIST, expanded)
    step: int | None = None  # SLURM_STEP_ID: which srun of the job's script (None: the script itself)
    array_job: str | None = None  # SLURM_ARRAY_JOB_ID

    @property
    def name(self) -> str:
        """This job as scontrol names it alone: an array's task as ARRAY_TASK (one of its tasks has the array's
        own id as its SLURM_JOB_ID, and `scontrol requeue ID` would requeue every task of the array)."""
        return f"{self.array_job}_{self.array_task}" if self.array_job and self.array_task is not None else self.job_id


@dataclass(frozen=True)
class Environment:
    # "local": paratrain starts the workers; "torchrun" or "slurm": this process is one of them
    launcher: str = "local"
    rank: int = 0  # this process's rank in the launcher's group (local: 0, the process that launches)
    world_size: int = 1  # the launcher's group (local: the plan decides how many workers)
    local_rank: int = 0
    local_world_size: int = 1  # the launcher's workers on this node
    restarts: int = 0  # how often the launcher started this node's workers again (torchrun --max-restarts)
    # where the group meets, for a launcher whose rendezvous is not in the process's environment (Slurm); None:
    # torchrun's env://
    master_addr: str | None = None
    master_port: int | None = None
    slurm: SlurmJob | None = None  # the Slurm job around this process, whichever launcher started it
    cpus_per_task: int | None = None  # the cores the launcher gave this process (srun --cpus-per-task)
    node_rank: int = 0  # this node's place among the launcher's nodes
    node_count: int | None = None  # the launcher's nodes, where it says (srun's tasks may be uneven across them)

    @property
    def in_group(self) -> bool:
        """A launcher formed the group and started this process as one of its ranks (it must not spawn)."""
        return self.launcher != "local"

    @property
    def is_main(self) -> bool:
        """This process speaks for the run: it prints, and writes the run folder."""
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return self.node_count or max(1, self.world_size // max(1, self.local_world_size))

    @property
    def launcher_name(self) -> str:
        """What summary.json records: spawn (paratrain started the workers), torchrun or slurm."""
        return "spawn" if self.launcher == "local" else self.launcher

    @property
    def init_method(self) -> str:
        """How a worker joins the group this launcher formed (torch.distributed's init_method)."""
        if self.master_addr is None:
            return "env://"
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


LOCAL = Environment()


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment `environ` (os.environ) describes: torchrun's variables (also under srun: `srun torchrun`),
    a Slurm step of several tasks, or a local start (in a Slurm job or not)."""
    environ = os.environ if environ is None else environ
    job = slurm_job(environ)
    if all(v in environ for v in TORCHRUN_VARS):
        world = int(environ["WORLD_SIZE"])
        return Environment("torchrun", int(environ["RANK"]), world, int(environ["LOCAL_RANK"]),
                           int(environ.get("LOCAL_WORLD_SIZE", world)),
                           int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), slurm=job,
                           node_rank=int(environ.get("GROUP_RANK", "0")))
    if job is not None and all(v in environ for v in SRUN_VARS):
        tasks = _int(environ, "SLURM_STEP_NUM_TASKS", None) or _int(environ, "SLURM_NTASKS", 1)
        if tasks > 1:  # a step of one task is a start like any other: paratrain lays its workers out itself
            return _srun_task(environ, job, tasks)
    return Environment(slurm=job)


def slurm_job(environ: Mapping[str, str]) -> SlurmJob | None:
    if "SLURM_JOB_ID" not in environ:
        return None
    return SlurmJob(environ["SLURM_JOB_ID"], _int(environ, "SLURM_RESTART_COUNT", 0),
                    _int(environ, "SLURM_ARRAY_TASK_ID", None),
                    tuple(expand_hostlist(environ.get("SLURM_JOB_NODELIST", ""))),
                    _int(environ, "SLURM_STEP_ID", None), environ.get("SLURM_ARRAY_JOB_ID") or None)


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} in the environment is not a whole number (Slurm sets it so): unset it, "
                        "or run under Slurm as it starts jobs") from None


def _srun_task(environ: Mapping[str, str], job: SlurmJob, tasks: int) -> Environment:
    """One task of an srun step: rank SLURM_PROCID of the step's tasks, its node's tasks by SLURM_LOCALID."""
    hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", ""))
    if not hosts:
        raise UserError("srun started this task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST")
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", ""))
    here = environ.get("SLURMD_NODENAME")
    node = hosts.index(here) if here in hosts else _int(environ, "SLURM_NODEID", 0)
    local_world = per_node[node] if node < len(per_node) else max(1, tasks // len(hosts))
    port = _int(environ, "MASTER_PORT", None) or job_port(job.job_id)
    return Environment("slurm", _int(environ, "SLURM_PROCID", 0), tasks, _int(environ, "SLURM_LOCALID", 0),
                       local_world, master_addr=environ.get("MASTER_ADDR") or hosts[0], master_port=port, slurm=job,
                       cpus_per_task=_int(environ, "SLURM_CPUS_PER_TASK", None), node_rank=node,
                       node_count=len(hosts))


def job_port(job_id: str) -> int:
    """The step's rendezvous port: a job's digits (an array task's too) spread over PORT_SPAN ports."""
    digits = int("".join(re.findall(r"\d", job_id)) or "0")
    return PORT_BASE + digits % PORT_SPAN


_BRACKET = re.compile(r"^(.*?)\[([^\]]*)\](.*)$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list in full, in order: "node[01-03,07],gpu-a[1-2]b" -> node01, node02,
    node03, node07, gpu-a1b, gpu-a2b (zero padding kept; brackets may appear more than once in a name)."""
    hosts: list[str] = []
    for item in _top_level_items(hostlist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _top_level_items(hostlist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, current = [], 0, ""
    for ch in hostlist:
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise UserError(f"unbalanced ']' in the Slurm host list {hostlist!r}")
        current += ch
    if depth:
        raise UserError(f"unbalanced '[' in the Slurm host list {hostlist!r}")
    items.append(current)
    return [i.strip() for i in items if i.strip()]


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.match(item)
    if match is None:
        return [item]
    head, ranges, tail = match.groups()
    names = []
    for part in ranges.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"the Slurm host list range {part!r} in {item!r} is not N or N-M")
        width = len(lo) if len(lo) > 1 and lo.startswith("0") else 0  # node[08-10]: node08, node09, node10
        for n in range(int(lo), int(hi or lo) + 1):
            names.append(f"{head}{n:0{width}d}")
    return [f"{name}{rest}" for name in names for rest in _expand_one(tail)]


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's form in full: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise UserError(f"SLURM_TASKS_PER_NODE {spec!r}: {part!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def user_cache() -> Path:
    """The user's cache folder for paratrain (XDG_CACHE_HOME, else ~/.cache): decoded images, text's tokens,
    --devices auto's kept rates, doctor's measured peak."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paratrain"
