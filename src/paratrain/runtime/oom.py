"""Whether a worker that died by SIGKILL was killed by the out-of-memory killer.

Only the cgroup that accounts a process's memory says so: cgroup v2's memory.events and v1's
memory.oom_control count `oom_kill`. A dead process's cgroup can no longer be read from /proc, so the
launcher notes each live worker's cgroup and its count as it waits (`OomWatch.note`), and compares after a
death. Where neither file can be read (not Linux, no memory controller) nothing can be known: the death stays
an ordinary, restartable one.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path


@cache
def _mounts() -> dict[str, tuple[Path, str]]:
    """Where the cgroup hierarchies are mounted: 'v2' and 'memory' (v1) -> (mount point, the hierarchy's
    path that is mounted there)."""
    found: dict[str, tuple[Path, str]] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, (fstype, *_, options) = fields.split(), tail.split() or ["", ""]
        if len(parts) < 5:
            continue
        root, point = parts[3], parts[4].replace("\\040", " ")  # mountinfo escapes a space in a path
        if fstype == "cgroup2":
            found.setdefault("v2", (Path(point), root))
        elif fstype == "cgroup" and "memory" in options.split(","):
            found.setdefault("memory", (Path(point), root))
    return found


def memory_cgroups(pid: int) -> list[Path]:
    """The folders of the cgroups that may account `pid`'s memory (v2's and v1's memory hierarchy, in the
    order /proc lists them)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    mounts, folders = _mounts(), []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        key = "v2" if controllers == "" else "memory" if "memory" in controllers.split(",") else None
        if key is None or key not in mounts:
            continue
        point, root = mounts[key]
        inside = os.path.relpath(path, root) if path == root or path.startswith(root.rstrip("/") + "/") \
            else path.lstrip("/")
        folders.append(point / inside if inside != "." else point)
    return folders


def oom_kills(folder: Path) -> int | None:
    """How many processes of the cgroup `folder` an out-of-memory killer killed; None where it does not say."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            text = (folder / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


class OomWatch:
    """The memory cgroups each live worker was seen in, with each one's OOM-kill count when first seen there."""

    def __init__(self) -> None:
        self.noted: dict[int, dict[Path, int]] = {}

    def note(self, pids: list[int]) -> None:
        """Note where each of `pids` is now. Every cgroup a worker was seen in is kept, with its first count:
        a worker the killer has just hit may take a while to exit, and meanwhile the kernel shows it in the
        root cgroup (cgroup v1 moves an exiting task there); its kill must not become the baseline."""
        for pid in pids:
            for folder in memory_cgroups(pid):
                count = oom_kills(folder)
                if count is not None:
                    self.noted.setdefault(pid, {}).setdefault(folder, count)
                    break

    def killed(self, pid: int) -> Path | None:
        """A cgroup `pid` was seen in whose OOM-kill count grew since; None if none did (or it was never seen)."""
        for folder, before in self.noted.get(pid, {}).items():
            now = oom_kills(folder)
            if now is not None and now > before:
                return folder
        return None
