"""The autoscaler's release warning reaches every user of a local box: each terminal its
processes hold outside the screen session (an editor's integrated terminal is such a PTY),
the session itself, `devbox ls`, and one desktop notification from the laptop's `devbox
proxy`; and a bare `devbox keep` in the box keeps it. Real agent, autoscaler, OpenSSH,
screen and PTYs; only `notify-send` is a stand-in (the laptop's program, not devbox's)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import PROMPT, User, ls_table
from tests.e2e.helpers import use_multiplexer
from tests.terminal import Terminal
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")

DEVBOX = f"{sys.executable} -m devbox"
# Warned after 10 quiet seconds, released 30 s later: time to look everywhere first.
SETTINGS = """
idle_timeout = 40
warning = 30
grace = 0
interval = 0.5
unhealthy_after = 60
unhealthy_release_after = 120
"""
# A process of the box that holds a PTY the way an editor's terminal does: a shell on the
# slave side, and what reaches the master side written to a file.
PTY_HOLDER = """
import os, pty, sys
out = open(sys.argv[1], "ab", buffering=0)
pid, master = pty.fork()
if pid == 0:
    os.execvp("sh", ["sh", "-c", "echo pty-ready; exec sleep 600"])
while True:
    try:
        data = os.read(master, 4096)
    except OSError:
        break
    if not data:
        break
    out.write(data)
"""
WARNED = "devbox: box w has been idle; it will be released at "


def _ls(user: User) -> dict[str, dict[str, object]]:
    return {b["name"]: b for b in json.loads(user.devbox("ls", "--json", check=True).stdout)}


def _fake_notify_send(folder: Path, record: Path) -> Path:
    folder.mkdir()
    script = folder / "notify-send"
    script.write_text(f'#!/bin/sh\nprintf "%s|" "$@" >> {record}\necho >> {record}\n')
    script.chmod(0o755)
    return folder


def _bridge(user: User, env: dict[str, str], command: str) -> subprocess.Popen[bytes]:
    """`ssh w.devbox COMMAND` through `devbox proxy`, running on."""
    return subprocess.Popen(
        ["ssh", "-F", str(user.ssh_config), "w.devbox", command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_warning_reaches_every_terminal_ls_and_the_desktop_and_keep_holds_the_box(
    user: User, term: Terminal, tmp_path: Path
) -> None:
    use_multiplexer(user, "screen")
    user.up("w")
    user.devbox("ssh-config", "--write", check=True)
    home = user.box_dir("w") / "home"
    (home / "ptyholder.py").write_text(PTY_HOLDER)
    record = tmp_path / "notified.txt"
    laptop = dict(user.env)
    laptop["PATH"] = f"{_fake_notify_send(tmp_path / 'bin', record)}:{laptop['PATH']}"
    # Two connections bridged at once, as VS Code holds them: one runs the PTY holder.
    bridges = [
        _bridge(user, laptop, f"exec $DEVBOX_PYTHON {home}/ptyholder.py {home}/pty.out"),
        _bridge(user, laptop, "exec sleep 600"),
    ]
    autoscaler = None
    try:
        wait_until(
            lambda: (
                b"pty-ready" in (home / "pty.out").read_bytes()
                if (home / "pty.out").exists()
                else False
            ),
            30,
            "the PTY holder's shell",
        )
        shell = term.start(f"{DEVBOX} ssh w")
        term.wait_for(shell, PROMPT)
        config = user.home / ".config/devbox/autoscaler.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(SETTINGS)
        with open(user.home / "autoscaler.log", "wb") as log:
            autoscaler = subprocess.Popen(
                [sys.executable, "-m", "devbox", "autoscaler"],
                env=user.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

        # (b) The screen session, as before, through screen's own message line.
        term.wait_for(shell, WARNED, timeout=90)
        # (a) The PTY outside the session: the line, on a line of its own.
        out = home / "pty.out"
        wait_until(lambda: WARNED.encode() in out.read_bytes(), 30, "the warning on the PTY")
        line = out.read_bytes().split(WARNED.encode(), 1)[1].split(b"\n", 1)[0].decode().strip()
        assert line.endswith("(`devbox keep` here or `devbox keep w` holds it)"), line
        assert out.read_bytes().count(WARNED.encode()) == 1
        # Never raw text in the screen client's own terminal: only screen's message line
        # (the last row) may show it, never a row of the window.
        rows = term.screen(shell).splitlines()
        assert not [r for r in rows[:-1] if "has been idle" in r], "\n".join(rows)

        # `devbox ls`: when, as a clock too.
        release_at = float(_ls(user)["w"]["release_at"])  # type: ignore[arg-type]
        clock = time.strftime("%H:%M:%S", time.localtime(release_at))
        listed = user.devbox("ls", check=True)
        assert ls_table(listed.stdout.decode())["w"]["RELEASE"].startswith("in ")
        note = listed.stderr.decode()
        assert "w: idle: released in " in note and f"(or `devbox keep w`); at {clock}" in note
        assert clock in line

        # The laptop: one desktop notification, for two bridges.
        # (Counted at the end, when both bridges have looked many times: every 2 s.)
        wait_until(record.exists, 30, "a desktop notification")

        # A bare `devbox keep` in the box's terminal keeps the box it runs in.
        term.type(shell, "$DEVBOX_PYTHON -m devbox keep; echo kept-status=$?")
        term.wait_for(shell, "kept-status=0")
        assert "box w is kept until" in term.screen(shell)
        wait_until(lambda: _ls(user)["w"]["release_at"] == 0, 30, "the warning withdrawn")
        assert float(_ls(user)["w"]["keep_until"]) > time.time() + 3 * 3600  # type: ignore[arg-type]
        # The withdrawal goes the same way as the warning.
        wait_until(
            lambda: b"devbox: box w will not be released: " in out.read_bytes(),
            30,
            "the withdrawal on the PTY",
        )
        rows = term.screen(shell).splitlines()
        assert not [r for r in rows[:-1] if "has been idle" in r], "\n".join(rows)
        notes = record.read_text().splitlines()
        assert len(notes) == 1, notes
        assert notes[0].startswith(
            f"--app-name=devbox|devbox: box w will be released at {clock[:5]}|"
        )
        assert "box w has been idle" in notes[0] and "`devbox keep w` holds it" in notes[0]
    finally:
        if autoscaler is not None:
            autoscaler.terminate()
            autoscaler.wait(timeout=20)
        for bridge in bridges:
            bridge.kill()
            bridge.wait(timeout=20)


def test_a_bare_keep_outside_a_box_says_so_in_one_line(user: User) -> None:
    user.up("w")
    no_box = user.devbox("keep")
    assert no_box.returncode == 2
    assert no_box.stderr.decode().splitlines() == [
        "devbox: error: name the box to keep: `devbox keep NAME` (in a box, NAME is optional)"
    ]
    user.env["DEVBOX_BOX"] = "w"  # as in a pod's terminal, or a stale variable here
    elsewhere = user.devbox("keep")
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.decode().splitlines() == [
        "devbox: error: a bare `devbox keep` keeps the local box it runs in, and this is not "
        "in one: `devbox keep w` where you claimed box w keeps it"
    ]
    assert _ls(user)["w"]["keep_until"] == 0
