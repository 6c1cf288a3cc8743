"""A warm `paratrain` for the tests: a process that has imported torch and the command line once, and forks
one child per command (tests/warm_client.py sends it). Each `paratrain` command of a test started afresh
spent ~3.3 s of CPU importing torch before it did anything (4 CPU-s of 9 in a 20-step run); the tests start
some 190 of them. A child is as a fresh `python -m paratrain` would be: the client's arguments, folder,
environment and standard streams, its own process group, Python's random numbers drawn anew, and
`python -m paratrain` run by runpy; paratrain's own forkserver does the same for its workers
(runtime/prefork.py). Nothing here has run a torch operation before a fork (OpenMP's threads do not survive
one), and it stays one thread.

Protocol (a SOCK_SEQPACKET socket): the client sends its JSON request with its fds 0, 1 and 2; the server
answers the child's pid, then its exit code as os.waitstatus_to_exitcode gives it. A client that goes away
(killed by a test's timeout) takes its child's process group with it. The server ends with its parent.

Run as `python tests/warm_server.py SOCKET LOG`, its standard error to LOG. What its imports wrote there (a
warning) each child writes to its own standard error first. Left as they were: a signal sent to the client is
passed on to the command's launcher alone (a fresh command's process group would take one sent to the group:
tests of that start fresh processes), and Python's hash seed is the server's for each command.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
from pathlib import Path


def _child(message: bytes, fds: list[int], said: bytes) -> None:
    """In the forked child: become the client's `python -m paratrain ARGV`, and never return. `said`: what the
    server's imports wrote to its standard error (a warning), which a fresh command would have written."""
    import random
    import runpy

    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
            os.close(fd)
        if said:
            os.write(2, said)
        request = json.loads(message)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts it first
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # drawn anew, as a fresh interpreter's are
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        sys.argv = ["paratrain", *request["argv"]]
        runpy.run_module("paratrain", run_name="__main__", alter_sys=True)  # its entry() leaves by os._exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _end(pid: int, selector: selectors.BaseSelector, children: dict[int, socket.socket]) -> None:
    """A command whose client went away: killed, with every process of its group (its forkserver, workers)."""
    conn = children.pop(pid)
    selector.unregister(conn)
    conn.close()
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)


def serve(path: str, log: str = "") -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)  # clients queue while torch imports
    import importlib

    from paratrain.runtime import prefork

    # what paratrain's forkserver preloads (torch, the optimizer step's torch._dynamo, the worker), less the
    # module that makes a forkserver of the process it is in; and the command line the launcher runs
    for name in [*prefork.PRELOAD, "paratrain.cli", "paratrain.session"]:
        if name != "paratrain.runtime._in_forkserver":
            importlib.import_module(name)
    # and what it preloads for a model file's libraries, which the launcher imports with the file (transformers'
    # modeling base: ~2 CPU-s for each command of a GPT-2 or a Llama; ~80 MB more in each command's peak)
    for name in prefork.LIBRARIES.values():
        importlib.import_module(name)  # each passes over a library that is not there
    sys.stderr.flush()
    said = Path(log).read_bytes() if log else b""  # its standard error is this file (conftest.warm_socket)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    for other in (listener, conn, *children.values()):
                        other.close()
                    _child(message, fds, said)
                with contextlib.suppress(OSError):  # the child may have made its group already
                    os.setpgid(pid, pid)  # its own group before anything may have to kill it
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                try:
                    conn.send(struct.pack("i", pid))
                except OSError:  # the client went away meanwhile (a test's timeout): so does its command
                    _end(pid, selector, children)
            else:  # the client went away before its command ended
                _end(key.data, selector, children)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                try:
                    conn.send(struct.pack("i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(*sys.argv[1:3])
