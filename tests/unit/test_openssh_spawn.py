"""`devbox ssh` starts OpenSSH with posix_spawn, not subprocess: ssh must still get what
subprocess gives a child, the default action for the signals Python ignores (SIGPIPE,
SIGXFSZ), and its exit status back, a signal as its negative number."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from devbox.ssh import openssh
from tests.tui.synthetic import make_box


def _fake_ssh(tmp_path: Path, body: str) -> str:
    script = tmp_path / "ssh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture(autouse=True)
def no_preflight(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(openssh, "preflight", lambda box: None)


def test_ssh_gets_the_default_action_for_sigpipe(tmp_path: Path) -> None:
    out = tmp_path / "status"
    ssh = _fake_ssh(tmp_path, f"grep SigIgn /proc/$$/status > {out}")
    assert openssh.run(ssh, make_box(0, 0), "true", tty=False) == 0
    ignored = int(out.read_text().split()[1], 16)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (signum - 1)), f"{signum!r} is ignored in ssh"


def test_the_exit_status_and_a_signal_come_back(tmp_path: Path) -> None:
    assert openssh.run(_fake_ssh(tmp_path, "exit 7"), make_box(0, 0), "x", tty=False) == 7
    killed = _fake_ssh(tmp_path, "kill -TERM $$")
    assert openssh.run(killed, make_box(0, 0), "x", tty=False) == -signal.SIGTERM
