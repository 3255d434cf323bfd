"""The agent as a container's PID 1: an init that reaps orphans and passes signals on.

In a pod the agent is the container's first process. PID 1 inherits every orphan of its
PID namespace (screen and tmux daemonise, so each session server is one, and so is
whatever a session leaves behind when it ends) and must reap them, or they stay zombies
for the life of the box; and the kernel gives PID 1 no default signal actions, so a
signal it does not handle does nothing. Reaping from inside the agent would race with
the agent's own child watchers (asyncio, subprocess) for their children's exit statuses.

So, as tini and dumb-init do: PID 1 forks; the child is the agent proper; PID 1 only
forwards signals to it and reaps, and exits with the agent's status, at which the kernel
ends every other process of the container. It forks before anything heavy is imported,
so PID 1 costs a bare interpreter's pages, most of them shared with the agent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def become_init_if_pid1() -> None:
    """Returns at once in the agent proper; as PID 1 never returns (it exits)."""
    if os.getpid() != 1:
        return
    # Held back across the fork: the kernel drops a signal PID 1 has no handler for, and
    # one sent between the fork and the handlers below (the agent already running, on a
    # loaded machine) was lost. Held signals are delivered once they are let through.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: _forward(child, signum))
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    sys.exit(_reap_until(child))


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:  # it has just exited: the reaper sees it
        pass
    except PermissionError:
        # The agent runs as its owner and this init lacks CAP_KILL (a pod made without
        # it): dying here would end the box at once, so say it and keep reaping; the
        # kubelet's SIGKILL ends the box when the grace is over.
        with contextlib.suppress(OSError):
            os.write(
                2, f"devbox init: cannot pass signal {signum} to the agent (no CAP_KILL)\n".encode()
            )


def _reap_until(child: int) -> int:
    """Reaps every child until the agent itself exits; returns its exit status."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # no child at all: cannot happen while the agent lives
            return 1
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as sh
