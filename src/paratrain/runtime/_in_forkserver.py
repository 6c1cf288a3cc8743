"""Imported by the forkserver alone, first (prefork.PRELOAD): it ignores SIGTERM.

A SIGTERM to the whole process group (timeout, systemd's stop, a scheduler's time limit) would otherwise
end the forkserver at once, and with it (PR_SET_PDEATHSIG) every worker in the middle of its step, before
it saves. Ignoring it, the forkserver lets the workers take the signal as spawned ones would: they save at
the step and stop. Each forked worker takes SIGTERM back first thing (prefork.detach). The forkserver
ignores SIGINT by itself, and ends when the launcher does.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
