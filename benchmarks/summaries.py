"""Not a benchmark: what the benchmarks that time `paratrain train` share. One run in a process of its own (as a
user starts it), its summary.json read back; a failed run ends the benchmark with its error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def trained(flags: list[str], out: Path) -> dict:
    """`python -m paratrain train FLAGS --out OUT`'s summary.json."""
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *flags, "--out", str(out)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads((out / "summary.json").read_text())
