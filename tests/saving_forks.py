"""Processes that save checkpoints until they are killed, for the tests of a kill at any moment of a save
(test_checkpoint, test_async_checkpoint): forked, one for each kill, from this process, which has imported torch
once. Each kill's fresh `python -c` spent ~3 s of CPU importing it, 25 times in the integration tier.

    python tests/saving_forks.py KIND      KIND: dcp (step folders, saved in the loop) or background
                                           (RunCheckpoints' background saves)

Each line read from standard input is a folder: a child is forked that saves into it, step after step,
printing "step N" once step N is asked for (dcp: written; background: the one before it is written); this
process prints "pid P" for it, waits for its end (the test's SIGKILL), and prints "ended". Nothing here runs a
torch operation before a fork (OpenMP's threads do not survive one): each child is as fresh as a new process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from paratrain.checkpoint import dcp
from paratrain.checkpoint.manager import RunCheckpoints
from paratrain.runtime.dist import DistContext

ONE = DistContext(0, 1, torch.device("cpu"), None)


def save_steps(folder: str) -> None:
    step = 0
    while True:
        step += 1
        big = torch.full((4_000_000,), float(step))  # 16 MB: a save takes long enough to be hit mid-way
        meta = {"optimizer": None, "step": step, "epoch": 0, "config": {"model": "x"}}
        dcp.save_step(ONE, {"model": {"w": big}}, lambda meta=meta: meta, folder, step, keep=2)
        print(f"step {step}", flush=True)


def save_in_background(run: str) -> None:
    owner = RunCheckpoints(run, ONE, background=True)
    w = torch.zeros(4_000_000)  # 16 MB
    step = 0
    while True:
        step += 1
        w.fill_(float(step))
        owner.save_sharded(owner.ctx, {"model": {"w": w}, "optimizer": {}},
                           lambda step=step: {"step": step, "epoch": 0, "config": {"model": "x"}}, step, keep=2)
        print(f"step {step}", flush=True)  # asked for: it is written while the next is prepared


def main(kind: str) -> None:
    writer = {"dcp": save_steps, "background": save_in_background}[kind]
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                writer(line.strip())
            finally:
                os._exit(1)
        print(f"pid {pid}", flush=True)
        os.waitpid(pid, 0)
        print("ended", flush=True)


class SavingForks:
    """The test's side: this file as a process, whose savers it starts and kills one at a time."""

    def __init__(self, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def start(self, folder: str | os.PathLike, steps: int) -> int:
        """A saver into `folder`, once it has printed `steps` steps: its pid."""
        self.proc.stdin.write(f"{folder}\n")
        self.proc.stdin.flush()
        pid, seen = None, 0
        while pid is None or seen < steps:
            line = self.proc.stdout.readline()
            assert line, "the saving process ended"
            if line.startswith("pid "):
                pid = int(line.split()[1])
            elif line.startswith("step "):
                seen += 1
        return pid

    def kill(self, pid: int) -> None:
        """SIGKILL to the saver, and wait until it has ended."""
        os.kill(pid, signal.SIGKILL)
        while (line := self.proc.stdout.readline()) and line.strip() != "ended":
            pass

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    main(sys.argv[1])
