"""Issue 16 (11): a full state disk never refuses a session. The box's state folder (its
record, activity file, logs) lies on a real, really full filesystem: a small tmpfs filled
to the last block after the box came up. Activity and other bookkeeping are lost for a
while; `devbox ssh NAME -- CMD`, an interactive pty session and plain OpenSSH all work."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PROMPT, User
from tests.terminal import Terminal
from tests.waiting import wait_until

DEVBOX = f"{sys.executable} -m devbox"


def _fill(folder: Path) -> None:
    """Write until the filesystem says ENOSPC: every block is taken."""
    chunk = b"\0" * (64 * 1024)
    with open(folder / "filler", "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]


def _is_full(folder: Path) -> bool:
    try:
        with open(folder / "probe-write", "wb", buffering=0) as f:
            f.write(b"x" * 4096)
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno == errno.ENOSPC
    finally:
        with contextlib.suppress(OSError):
            (folder / "probe-write").unlink()
    return False


@pytest.fixture
def full_state(user: User) -> Iterator[Path]:
    """The user's XDG state folder on its own 4 MiB tmpfs (filled by the test)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    state = user.home / ".local/state"
    state.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(state)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield state
    finally:
        user.stop_all()  # the agents hold files there: stop them before the unmount
        subprocess.run(["umount", "-l", str(state)], capture_output=True, check=False)


def test_a_full_state_disk_refuses_no_session(user: User, full_state: Path, term: Terminal) -> None:
    user.up("full")
    activity = user.box_dir("full") / "activity.json"
    wait_until(activity.exists, 20, "the agent's first activity record")
    _fill(full_state)
    assert _is_full(full_state)
    # Several sessions in a row: the first failed write must not break the next either.
    for word in ("one", "two", "three"):
        done = user.devbox("ssh", "full", "--", "echo", word)
        assert (done.returncode, done.stdout) == (0, f"{word}\n".encode()), done.stderr
    status = user.devbox("ssh", "full", "--", "exit 3")
    assert status.returncode == 3, status.stderr
    # Plain OpenSSH through the generated config (ProxyCommand `devbox proxy`), and the
    # config itself: `ssh-config` re-pins every box's host key, an unchanged pin on a full
    # disk included.
    assert user.devbox("ssh-config").returncode == 0
    plain = user.ssh("full.devbox", "echo plain-ok")
    assert (plain.returncode, plain.stdout) == (0, b"plain-ok\n"), plain.stderr
    # The built-in client too (machines without OpenSSH).
    user.env["DEVBOX_SSH_CLIENT"] = "builtin"
    builtin = user.devbox("ssh", "full", "--", "echo", "builtin-ok")
    assert builtin.stdout == b"builtin-ok\n", builtin.stderr
    del user.env["DEVBOX_SSH_CLIENT"]
    # An interactive pty session, typed into (each keystroke is activity, never written).
    shell = term.start(f"{DEVBOX} ssh full")
    term.wait_for(shell, PROMPT)
    term.type(shell, "echo typed-$((6*7))")
    term.wait_for(shell, "typed-42")
    # Still full, and the agent still serves: nothing was freed behind the test's back.
    assert _is_full(full_state)
    again = user.devbox("ssh", "full", "--", "echo", "still")
    assert again.stdout == b"still\n", again.stderr
    assert user.devbox("ls", "--json").returncode == 0
    # Once space is back the activity file is written again (the failure was not fatal).
    (full_state / "filler").unlink()
    before = activity.stat().st_mtime_ns

    def rewritten() -> bool:
        term.type(shell, "true")
        return activity.stat().st_mtime_ns != before

    wait_until(rewritten, 20, "the activity file written again", every=0.5)


def test_failed_activity_writes_are_logged_once_and_recovered(
    full_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.activity import Activity

    path = full_state / "activity.json"
    _fill(full_state)
    activity = Activity(path)
    with caplog.at_level(logging.INFO, logger="devbox.agent"):
        for _ in range(50):  # each session's open and close forces a write
            activity.client(+1)
            activity.client(-1)
        activity.input()
    failed = [r for r in caplog.records if "cannot write the activity file" in r.message]
    assert len(failed) == 1 and "No space left on device" in failed[0].message, caplog.text
    assert not path.exists() and os.listdir(full_state) == ["filler"]  # no half-files left
    (full_state / "filler").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="devbox.agent"):
        activity.client(+1)
    assert json.loads(path.read_text())["clients"] == 1
    assert "written again" in caplog.text
