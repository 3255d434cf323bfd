"""The agent as PID 1 of a container: orphans are reaped, signals reach the agent, and its
exit status is the container's. Run in a real PID namespace of its own (unshare)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.waiting import wait_until

# The "agent": after become_init_if_pid1 it makes an orphan (a double fork, as screen and
# tmux daemonise) and reports once nothing but PID 1 and itself is left in the namespace:
# a zombie would stay in /proc until somebody reaped it.
AGENT = textwrap.dedent(
    """
    import os, sys, time, signal
    sys.path.insert(0, sys.argv[1])
    from agent.init import become_init_if_pid1
    become_init_if_pid1()
    print("agent pid", os.getpid(), flush=True)
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            time.sleep(0.2)
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    def others():
        return [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
    deadline = time.monotonic() + 20
    while others() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("left", others(), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print("ready", flush=True)
    time.sleep(60)
    """
)


def _init_of(unshare: int) -> int:
    """PID 1 of the namespace, seen from here: unshare's only child."""
    children = Path(f"/proc/{unshare}/task/{unshare}/children")
    return int(wait_until(lambda: children.read_text().strip(), what="the namespace's PID 1"))


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of its own needs root")
def test_pid1_reaps_orphans_forwards_signals_and_exits_with_the_agent(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script), str(REPO)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["agent", "pid", "2"]
        assert proc.stdout.readline().strip() == "left []", "the orphan stayed a zombie"
        assert proc.stdout.readline().strip() == "ready"
        init = _init_of(proc.pid)
        os.kill(init, signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
    finally:
        proc.kill()
        proc.wait()


# An agent that became its owner (another uid), under an init without CAP_KILL: the
# kubelet's SIGTERM cannot be passed on. Before, the init died of EPERM, which ended the
# whole box at once, before anything in it could save.
OWNED = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from agent.init import become_init_if_pid1
    become_init_if_pid1()
    os.setuid(65534)
    print("ready", flush=True)
    time.sleep(60)
    """
)


NO_CAP_KILL = ("setpriv", "--bounding-set", "-kill", "--inh-caps", "-kill", "--")


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace of its own needs root")
def test_pid1_without_cap_kill_says_so_and_lives_on(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(OWNED)
    proc = subprocess.Popen(
        [
            *NO_CAP_KILL,
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            str(script),
            str(REPO),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "ready"
        init = _init_of(proc.pid)
        os.kill(init, signal.SIGTERM)
        line = proc.stderr.readline()
        assert line.strip() == "devbox init: cannot pass signal 15 to the agent (no CAP_KILL)"
        assert proc.poll() is None  # the box lives on until its grace ends
    finally:
        proc.kill()
        proc.wait()
