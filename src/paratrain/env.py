"""The process environment: who started this process, and its place in the group. Read here, once per entry.

A run is started either on this machine (paratrain spawns its own workers: `local`) or by a launcher that
formed the group itself and started this process as one of its ranks (`torchrun`, whose variables say the
rank, the world size and the local rank). Every question of the kind "am I rank 0 / did torchrun start us"
is answered by an `Environment`; a new launcher (Slurm's srun) is one more branch of `detect`.
This module imports no torch: the command line asks it before torch is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Environment:
    launcher: str = "local"  # "local": paratrain starts the workers; "torchrun": this process is one of them
    rank: int = 0  # this process's rank in the launcher's group (local: 0, the process that launches)
    world_size: int = 1  # the launcher's group (local: the plan decides how many workers)
    local_rank: int = 0
    local_world_size: int = 1  # the launcher's workers on this node
    restarts: int = 0  # how often the launcher started this node's workers again

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
        return max(1, self.world_size // max(1, self.local_world_size))


LOCAL = Environment()


def detect(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment `environ` (os.environ) describes: torchrun's variables, or a local start."""
    environ = os.environ if environ is None else environ
    if all(v in environ for v in TORCHRUN_VARS):
        world = int(environ["WORLD_SIZE"])
        return Environment("torchrun", int(environ["RANK"]), world, int(environ["LOCAL_RANK"]),
                           int(environ.get("LOCAL_WORLD_SIZE", world)),
                           int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return LOCAL
