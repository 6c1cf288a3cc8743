"""Imported by the forkserver alone, first (prefork.PRELOAD): it ignores SIGTERM, and leaves without finalization.

A SIGTERM to the whole process group (timeout, systemd's stop, a scheduler's time limit) would otherwise
end the forkserver at once, and with it (PR_SET_PDEATHSIG) every worker in the middle of its step, before
it saves. Ignoring it, the forkserver lets the workers take the signal as spawned ones would: they save at
the step and stop. Each forked worker takes SIGTERM back first thing (prefork.detach). The forkserver
ignores SIGINT by itself, and ends when the launcher does.

It ends by os._exit once its exit handlers have run (its streams flushed first): tearing down the torch it
imported took 1.5 s, and it holds the launcher's standard streams all that time, so `paratrain ... | tail` or
a subprocess reading the command's output waited for it. Its workers inherit the handler but never run it
(multiprocessing ends them with os._exit); the pid check keeps it the forkserver's alone all the same.
"""

import atexit
import os
import signal
import sys

signal.signal(signal.SIGTERM, signal.SIG_IGN)
_FORKSERVER = os.getpid()


def _leave() -> None:
    if os.getpid() == _FORKSERVER:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# exit handlers run in reverse: those of the modules preloaded after this one (torch's) run before it;
# multiprocessing's own (registered before, with nothing to do in a process that has no children of its
# own) does not
atexit.register(_leave)
