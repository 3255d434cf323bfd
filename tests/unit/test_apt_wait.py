"""scripts/apt-get-waiting: the README's test command waits for another apt instead of
failing at once (a fresh VM runs its automatic updates on first boot)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/apt-get-waiting"

pytestmark = pytest.mark.skipif(
    shutil.which("apt-get") is None or os.geteuid() != 0,
    reason="needs apt-get and root (apt's locks are root's)",
)

HOLD = """
import fcntl, sys
files = [open(p, "a") for p in sys.argv[1:]]
for f in files:
    fcntl.lockf(f, fcntl.LOCK_EX)  # as apt takes them; waits for another test's holder
print("held", flush=True)
sys.stdin.read()  # until the test lets go
"""


@pytest.fixture
def apt_busy() -> Iterator[subprocess.Popen[str]]:
    """Another apt, as far as the locks tell: dpkg's and the package lists'."""
    locks = ["/var/lib/dpkg/lock-frontend", "/var/lib/dpkg/lock", "/var/lib/apt/lists/lock"]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, *locks],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    yield holder
    holder.kill()
    holder.wait()


def test_plain_apt_get_fails_at_once_while_another_apt_runs(
    apt_busy: subprocess.Popen[str],
) -> None:
    # The reason the script exists: apt's own lock timeout does not cover this.
    plain = subprocess.run(
        ["apt-get", "-o", "DPkg::Lock::Timeout=1", "check"], capture_output=True, text=True
    )
    assert plain.returncode != 0 and "lock" in plain.stderr


def test_waits_for_the_other_apt_then_runs(apt_busy: subprocess.Popen[str]) -> None:
    waiter = subprocess.Popen(
        [str(SCRIPT), "-qq", "check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert waiter.stderr is not None
    assert "waiting" in waiter.stderr.readline()
    assert waiter.poll() is None  # still waiting while the locks are held
    assert apt_busy.stdin is not None
    apt_busy.stdin.close()  # the other apt ends
    apt_busy.wait()
    assert waiter.wait(timeout=60) == 0


def test_gives_up_after_its_limit_with_one_line(apt_busy: subprocess.Popen[str]) -> None:
    result = subprocess.run(
        [str(SCRIPT), "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "DEVBOX_APT_WAIT": "0"},
        timeout=60,
    )
    assert result.returncode == 100
    assert "is still held after 0s" in result.stderr.splitlines()[-1]
