"""Decisions made once (issue 47): on one `paratrain train --devices 2 --resume RUN`, how often each process
detects its environment, computes the run's length, lists the run's checkpoints and opens a checkpoint.

    python benchmarks/decisions_once.py            # needs strace for the file columns (apt install strace)

Calls are counted by a profile hook that a sitecustomize module installs in every process of the run (the
launcher, the forkserver and the workers it forks); files by `strace -f -e trace=openat`. Prints one row per
process: the launcher, and each worker.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = '''
import os, sys
WATCH = {("env.py", "detect"), ("length.py", "run_length"), ("run_folder.py", "step_checkpoints"),
         ("files.py", "load")}
def _profile(frame, event, arg):
    if event == "call":
        code = frame.f_code
        if (os.path.basename(code.co_filename), code.co_name) in WATCH and "paratrain" in code.co_filename:
            with open(os.environ["COUNT_CALLS_LOG"], "a") as f:
                f.write(f"{os.getpid()} {code.co_name}\\n")
if os.environ.get("COUNT_CALLS_LOG"):
    sys.setprofile(_profile)
'''


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="paratrain-once-"))
    run, hook, calls, trace = work / "run", work / "hook", work / "calls.log", work / "strace.log"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    common = ["--devices", "2", "--quiet", "--no-tensorboard"]
    subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "lenet5", "--dataset", "digits",
                    "--steps", "20", "--checkpoint-every", "10", "--out", str(run), *common], check=True,
                   capture_output=True)
    env = {**os.environ, "COUNT_CALLS_LOG": str(calls), "PYTHONPATH": str(hook)}
    strace = shutil.which("strace")
    head = [strace, "-f", "-qq", "-e", "trace=openat", "-o", str(trace)] if strace else []
    launcher = subprocess.Popen([*head, sys.executable, "-m", "paratrain", "train", "--resume", str(run),
                                 "--steps", "40", *common], env=env)
    if launcher.wait():
        return launcher.returncode
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in calls.read_text().splitlines():
        pid, name = line.split()
        counts[pid][name] += 1
    opened: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    if strace:
        pattern = re.compile(r'^(\d+) +openat\(AT_FDCWD, "([^"]+)"')
        for line in trace.read_text().splitlines():
            m = pattern.match(line)
            if m and "ENOENT" not in line and m.group(2).startswith(str(run / "checkpoints")):
                what = "listing" if m.group(2) == str(run / "checkpoints") else \
                    "checkpoint read" if re.search(r"/step-\d+/meta\.pt$|/step-\d+\.pt$|/last\.pt$", m.group(2)) \
                    else "save"
                opened[m.group(1)][what] += 1
    first = min(counts, key=int)  # the launcher starts first, and logs first
    print("| process | detect() | run_length() | step_checkpoints() | checkpoint loads | opens of checkpoints/ "
          "| checkpoint files opened to read | files written |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for pid in sorted(set(counts) | set(opened), key=int):
        c, o = counts[pid], opened[pid]
        role = "launcher" if pid == first else f"worker (pid {pid})"
        print(f"| {role} | {c['detect']} | {c['run_length']} | {c['step_checkpoints']} | {c['load']} | "
              f"{o['listing'] if strace else '-'} | {o['checkpoint read'] if strace else '-'} | "
              f"{o['save'] if strace else '-'} |")
    print("\nA worker's listings past the first are its saves' (each prunes the old steps); rank 0 writes them.")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
