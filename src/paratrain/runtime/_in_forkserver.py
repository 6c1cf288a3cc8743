"""Imported by the forkserver alone, first (prefork.PRELOAD): it ignores SIGTERM, and leaves without finalization.

A SIGTERM to the whole process group (timeout, systemd's stop, a scheduler's time limit) would otherwise
end the forkserver at once, and with it (PR_SET_PDEATHSIG) every worker in the middle of its step, before
it saves. Ignoring it, the forkserver lets the workers take the signal as spawned ones would: they save at
the step and stop. Each forked worker takes SIGTERM back first thing (prefork.detach). The forkserver
ignores SIGINT by itself, and ends when the launcher does.

It ends by os._exit once its exit handlers have run: tearing down the torch it imported took 1.5 s, and it
holds the launcher's standard streams all that time, so `paratrain ... | tail` or a subprocess reading the
command's output waited for it. It has nothing to flush: it only imported and forked. Its workers inherit
the handler but never run it (multiprocessing ends them with os._exit); the pid check keeps it the
forkserver's alone all the same.
"""

import atexit
import os
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
_FORKSERVER = os.getpid()


def _leave() -> None:
    if os.getpid() == _FORKSERVER:
        os._exit(0)


atexit.register(_leave)  # registered first, so run last of the exit handlers (they run in reverse)
