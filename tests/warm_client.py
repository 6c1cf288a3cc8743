"""`paratrain ARGS` through the warm server (tests/warm_server.py), as a command: its exit code, its streams,
the signals it is sent passed on. It imports no torch (a Python start, some 30 ms). PARATRAIN_WARM names the
server's socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time


def main() -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + 120
    while True:  # the server binds its socket before it imports torch; a client this early waits for it
        try:
            server.connect(os.environ["PARATRAIN_WARM"])
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
    (pid,) = struct.unpack("i", server.recv(4))
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda n, _frame: os.kill(pid, n))
    answer = server.recv(4)
    if not answer:
        sys.exit("warm_client: the warm server went away")
    (code,) = struct.unpack("i", answer)
    if code < 0:  # ended by a signal: so is this process, as the command's own would be
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
