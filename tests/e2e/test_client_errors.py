"""What OpenSSH would refuse in silence (devbox runs it with LogLevel=QUIET), said in one
line: a key file's mode or owner, a changed pinned host key, and why rsync's ssh failed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devbox.protocol import fingerprint
from devbox.ssh.keys import ensure_user_key
from tests.conftest import User
from tests.e2e.helpers import impostor_agent

NOBODY = 65534


def key_of(user: User) -> Path:
    return user.home / ".config/devbox/id_ed25519"


def known_hosts_of(user: User) -> Path:
    return user.state / "known_hosts"


def one_line(result: subprocess.CompletedProcess[bytes]) -> str:
    text = result.stderr.decode()
    assert text.count("\n") == 1 and text.endswith("\n"), text
    return text.strip()


def project(tmp_path: Path) -> Path:
    src = tmp_path / "proj"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    return src


def test_a_devbox_key_others_can_read_is_made_0600_once(user: User, ssh_client: str) -> None:
    user.up("modes")
    key = key_of(user)
    key.chmod(0o644)
    done = user.devbox("ssh", "modes", "--", "true")
    assert done.returncode == 0, done.stderr
    assert one_line(done) == (
        f"devbox: warning: your devbox key {key} had mode 0644, which OpenSSH refuses "
        "for a private key; made it 0600"
    )
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    again = user.devbox("ssh", "modes", "--", "true")
    assert again.returncode == 0 and again.stderr == b""  # said once: nothing left to fix


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")
def test_plain_ssh_through_the_proxy_fixes_the_mode_too(user: User) -> None:
    user.up("plain")
    user.devbox("ssh-config", "--write", check=True)
    key_of(user).chmod(0o640)
    # ssh loads the key after the key exchange, which waits for the ProxyCommand's bridge.
    done = user.ssh("plain.devbox", "echo in")
    assert done.returncode == 0 and done.stdout == b"in\n", done.stderr
    assert "had mode 0640" in one_line(done)
    assert stat.S_IMODE(key_of(user).stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_key_another_user_owns_is_refused(user: User, ssh_client: str) -> None:
    user.up("theirs")
    key = key_of(user)
    os.chown(key, NOBODY, NOBODY)
    done = user.devbox("ssh", "theirs", "--", "true")
    assert done.returncode == 1
    assert one_line(done).startswith(
        f"devbox: error: your devbox key {key} belongs to uid {NOBODY}, not to you (uid 0): "
        f"refusing to use it; if it is yours, `chown 0 {key}`"
    )
    assert key.stat().st_uid == NOBODY  # refused, not taken over


@pytest.fixture
def changed_pin(user: User, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Box "pinned" up, and its pin in devbox's known_hosts swapped for another key's:
    (the published fingerprint, the pinned one)."""
    box = user.up("pinned")
    other = ensure_user_key(tmp_path / "other_key")
    known_hosts_of(user).write_text(f"pinned.devbox {' '.join(other.split()[:2])}\n")
    yield str(box["host_key_fingerprint"]), fingerprint(other)


def assert_names_the_change(line: str, fingerprints: tuple[str, str], user: User) -> None:
    published, pinned = fingerprints
    assert line.startswith("devbox: error: box pinned's host key has changed: "), line
    assert f"{known_hosts_of(user)} pins {pinned}" in line
    assert f"the box publishes {published}" in line and "`devbox ssh-config`" in line


def test_a_changed_pin_is_one_line_with_both_fingerprints(
    user: User, ssh_client: str, changed_pin: tuple[str, str]
) -> None:
    before = known_hosts_of(user).read_text()
    done = user.devbox("ssh", "pinned", "--", "true")
    assert done.returncode == 1
    assert_names_the_change(one_line(done), changed_pin, user)
    run = user.devbox("run", "--box", "pinned", "--no-sync", "--", "true")
    assert run.returncode == 1
    assert_names_the_change(run.stderr.decode().splitlines()[-1], changed_pin, user)
    assert known_hosts_of(user).read_text() == before  # never re-pinned behind the user's back

    # The way out the line names: ssh-config pins the published key, and says so.
    repinned = user.devbox("ssh-config")
    assert repinned.returncode == 0
    published, pinned = changed_pin
    assert one_line(repinned) == (
        f"devbox: warning: box pinned's pinned host key is now {published}, was {pinned}"
    )
    assert user.devbox("ssh", "pinned", "--", "true").returncode == 0


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_sync_with_a_changed_pin_is_one_line(
    user: User, tmp_path: Path, changed_pin: tuple[str, str], method: str
) -> None:
    if method == "rsync" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    user.env["DEVBOX_SYNC"] = method
    done = user.devbox("sync", "pinned", str(project(tmp_path)))
    assert done.returncode == 1
    assert_names_the_change(one_line(done), changed_pin, user)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")
def test_plain_ssh_with_a_changed_pin_gets_devboxs_line_not_the_banner(
    user: User, changed_pin: tuple[str, str]
) -> None:
    # Written before the pin changed: --write would pin the published key again.
    pinned_line = known_hosts_of(user).read_text()
    user.devbox("ssh-config", "--write", check=True)
    known_hosts_of(user).write_text(pinned_line)
    done = user.ssh("pinned.devbox", "true")
    assert done.returncode == 255
    text = done.stderr.decode()
    assert_names_the_change(text.splitlines()[0], changed_pin, user)
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" not in text


@pytest.fixture
def impostor(user: User, tmp_path: Path) -> Iterator[str]:
    """Box "fake" is up, but another agent, with another host key, answers on its port.
    Yields the impostor's host-key fingerprint."""
    user.up("fake")
    with impostor_agent(user, "fake", tmp_path) as fingerprint:
        yield fingerprint


def test_another_host_key_on_the_wire_names_both_fingerprints(
    user: User, ssh_client: str, impostor: str
) -> None:
    done = user.devbox("ssh", "fake", "--", "true")
    assert done.returncode == 1
    pinned = fingerprint(known_hosts_of(user).read_text().split(" ", 1)[1])
    assert one_line(done) == (
        f"devbox: error: box fake presented a host key that does not match the pinned {pinned} "
        f"(it presented {impostor}); refusing to connect: something else may be answering "
        "at its address"
    )


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
def test_sync_says_the_ssh_connection_failed_and_why(
    user: User, tmp_path: Path, impostor: str
) -> None:
    user.env["DEVBOX_SYNC"] = "rsync"
    done = user.devbox("sync", "fake", str(project(tmp_path)))
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("devbox: error: syncing ") and "rsync" not in line
    pinned = fingerprint(known_hosts_of(user).read_text().split(" ", 1)[1])
    assert line.endswith(
        "the SSH connection failed: box fake presented a host key that does not match the "
        f"pinned {pinned} (it presented {impostor}); refusing to connect: something else may "
        "be answering at its address"
    )
    assert "@@@" not in line


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
def test_sync_with_a_refused_key_names_the_key(user: User, tmp_path: Path) -> None:
    user.up("keyed")
    key = key_of(user)
    stranger = tmp_path / "stranger"
    ensure_user_key(stranger)
    shutil.copy(stranger, key)
    user.env["DEVBOX_SYNC"] = "rsync"
    done = user.devbox("sync", "keyed", str(project(tmp_path)))
    assert done.returncode == 1
    assert one_line(done).endswith(f"the SSH connection failed: box keyed refused your key {key}")
