"""A run on one machine lets no one else in: every socket its workers listen on is bound to loopback.

As root with `ip netns`, the run lives in a network namespace of its own, joined by a veth pair to another
namespace (10.78.0.1 and 10.78.0.2, made here and removed after), and a client there tries every port the
run listens on: each is refused. Elsewhere that part is skipped with its reason; the sockets' addresses
are checked either way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants, veth_namespaces

pytestmark = pytest.mark.integration


@pytest.fixture
def two_namespaces() -> list[str] | None:
    """Two network namespaces joined by a veth pair (None, with the reason printed, where they cannot be made)."""
    try:
        with veth_namespaces("10.78.0") as (names, _):
            yield names
            return
    except OSError as e:
        print(f"no network namespaces ({e}): the connection attempt from another address is skipped")
    yield None


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process ended meanwhile
        pass
    return inodes


def _decode(address: str) -> tuple[str, int]:
    """/proc/net/tcp{,6}'s hex address:port -> (ip, port)."""
    host, port = address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in reversed(raw))
    else:  # four 32-bit words, each in host (little-endian) order
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        ip = ":".join(b"".join(words)[i:i + 2].hex() for i in range(0, 16, 2))
    return ip, int(port, 16)


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pids[0]}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_decode(fields[1]))
    return found


LOOPBACK = ("127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001")


def test_a_two_worker_run_listens_on_loopback_only(tmp_path: Path, two_namespaces: list[str] | None) -> None:
    prefix = ["ip", "netns", "exec", two_namespaces[0]] if two_namespaces else []
    cmd = [*prefix, sys.executable, "-m", "paratrain", "train", "--devices", "2", "--steps", "100000", "--quiet",
           "--no-tensorboard", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        sockets: list[tuple[str, int]] = []
        deadline = time.monotonic() + 180
        # the store (rank 0) and each worker's gloo listener: 3 sockets once the group has formed
        while time.monotonic() < deadline and proc.poll() is None and len(sockets) < 3:
            time.sleep(0.5)
            sockets = listening([proc.pid, *descendants(proc.pid)])
        if len(sockets) < 3:  # its standard error is read once it has ended (a read of a live run waits for ever)
            _end(proc)
            pytest.fail(f"the run never formed its group: {sockets}; {proc.stderr.read()[-2000:]}")
        assert all(ip in LOOPBACK for ip, _ in sockets), sockets
        if two_namespaces:  # a client on another address of another machine: every port is refused
            for _, port in sockets:
                attempt = subprocess.run(
                    ["ip", "netns", "exec", two_namespaces[1], sys.executable, "-c",
                     f"import socket; socket.create_connection(('10.78.0.1', {port}), timeout=3)"],
                    capture_output=True, text=True)
                assert attempt.returncode != 0 and "ConnectionRefusedError" in attempt.stderr, (port, attempt.stderr)
    finally:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """End the run and every process of its session: SIGTERM, then SIGKILL for any left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # any process left holds its standard error open
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
