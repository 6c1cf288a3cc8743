"""How long a node cut off from the others keeps torchrun's agent there waiting.

The agent on a node that does not host the rendezvous asks the rendezvous store over TCP every monitor
interval. When the link goes, its request goes unanswered, and torch's TCPStore, having timed out, sends a
cancel and waits for its answer with no time limit of its own: the agent ends only when the kernel gives up on
the connection, after net.ipv4.tcp_retries2 retransmissions (15 by default: about 15 minutes). The workers end
after --collective-timeout; this is what `paratrain doctor` and the workers' timeout line tell the user.
"""

from __future__ import annotations

import math
from pathlib import Path

RETRIES_FILE = Path("/proc/sys/net/ipv4/tcp_retries2")
# Linux's model of when TCP gives up (tcp_model_timeout, net/ipv4/tcp_timer.c): the retransmission timeout
# doubles from its floor of 200 ms up to 120 s. A link with a longer round trip starts higher: a lower bound.
RTO_MIN_S, RTO_MAX_S = 0.2, 120.0
DOUBLINGS = 9  # ilog2(RTO_MAX_S / RTO_MIN_S): the retransmission after which the timeout stays at its cap


def tcp_retries2() -> int | None:
    """This network namespace's net.ipv4.tcp_retries2; None where it cannot be read (not Linux)."""
    try:
        return int(RETRIES_FILE.read_text())
    except (OSError, ValueError):
        return None


def give_up_s(retries: int) -> float:
    """At least how many seconds TCP keeps retransmitting unanswered data before it ends the connection."""
    if retries <= DOUBLINGS:
        return ((2 << retries) - 1) * RTO_MIN_S
    return ((2 << DOUBLINGS) - 1) * RTO_MIN_S + (retries - DOUBLINGS) * RTO_MAX_S


def fitting(timeout_s: float) -> int:
    """The fewest retransmissions after which TCP gives up no sooner than `timeout_s`: the agent then ends soon
    after its workers have said why, and an outage shorter than that still heals."""
    for retries in range(1, DOUBLINGS + 1):
        if give_up_s(retries) >= timeout_s:
            return retries
    return DOUBLINGS + max(0, math.ceil((timeout_s - give_up_s(DOUBLINGS)) / RTO_MAX_S))


def agent_wait(timeout_s: float, retries: int | None = None) -> str:
    """A clause for a multi-node torchrun worker's timeout line, where this node's setting would keep its
    agent waiting after a partition longer than the advised one; '' elsewhere (or where it cannot be read).
    Whether this node is the one cut off is not known here: the clause says what would happen if it were."""
    retries = tcp_retries2() if retries is None else retries
    advised = fitting(timeout_s)
    if retries is None or retries <= advised:
        return ""
    return (f"this node's net.ipv4.tcp_retries2 is {retries}: if it is cut off from the rendezvous host, torchrun's "
            f"agent here waits at least {give_up_s(retries):.0f} s for TCP to give up; `sysctl -w "
            f"net.ipv4.tcp_retries2={advised}` on each node makes that at least {give_up_s(advised):.0f} s")
