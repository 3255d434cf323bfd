"""The real OpenSSH client (Debian 12's 9.2) against a real agent started by `devbox up`:
it negotiates the post-quantum sntrup761x25519 key exchange when it asks for it
(agent.pqkex, through the pqcrypto wheel; devbox's own blocks leave it out) and AES-GCM
(agent.sshspeed); a large download and upload arrive
byte-exact; and an agent whose Python has no pqcrypto still starts and serves, on X25519."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import User

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")


def _negotiated(stderr: bytes) -> tuple[str, str]:
    """The key exchange and the server-to-client cipher, from `ssh -v`'s debug lines."""
    text = stderr.decode(errors="replace")
    kex = re.search(r"kex: algorithm: (\S+)", text)
    cipher = re.search(r"kex: server->client cipher: (\S+)", text)
    assert kex and cipher, text
    return kex[1], cipher[1]


def test_openssh_negotiates_sntrup761_and_aes_gcm(user: User) -> None:
    user.up("pq")
    # Whoever asks for it gets it: both names OpenSSH knows it by (8.5 to 9.8: the
    # @openssh.com one; Debian's 9.2 also the plain one, which it prefers by default).
    for name in ("sntrup761x25519-sha512", "sntrup761x25519-sha512@openssh.com"):
        result = user.ssh("-vvv", "-o", f"KexAlgorithms={name}", "pq.devbox", "true")
        assert result.returncode == 0, result.stderr.decode()
        kex, cipher = _negotiated(result.stderr)
        assert kex == name and cipher == "aes128-gcm@openssh.com"


def test_devbox_own_blocks_leave_sntrup761_out(user: User) -> None:
    """The `Host NAME.devbox` blocks (and devbox's own ssh runs) take the client's defaults
    less sntrup761, whose key pair OpenSSH 9.0-9.8 make in tens of milliseconds a
    connection (devbox.ssh.openssh.KEX_ALGORITHMS): Debian's 9.2 then takes X25519."""
    user.up("fast")
    result = user.ssh("-v", "fast.devbox", "true")
    assert result.returncode == 0, result.stderr.decode()
    kex, cipher = _negotiated(result.stderr)
    assert kex == "curve25519-sha256" and cipher == "aes128-gcm@openssh.com"
    env = {**user.env, "DEVBOX_SSH_CLIENT": "auto"}
    own = subprocess.run(
        [sys.executable, "-m", "devbox", "ssh", "fast", "--", "true"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert own.returncode == 0, own.stderr.decode()


def test_a_large_download_and_upload_arrive_byte_exact(user: User) -> None:
    data = os.urandom(24 * 1024 * 1024 + 4321)  # not a whole number of packets
    (user.home / "big.bin").write_bytes(data)
    user.up("bulk")
    down = user.ssh("bulk.devbox", "cat big.bin", timeout=120)
    assert down.returncode == 0, down.stderr.decode()
    assert len(down.stdout) == len(data) and down.stdout == data
    up = user.ssh("bulk.devbox", "cat > up.bin", input=data, timeout=120)
    assert up.returncode == 0, up.stderr.decode()
    assert (user.home / "up.bin").read_bytes() == data


def test_the_agent_starts_and_serves_without_pqcrypto(user: User, tmp_path: Path) -> None:
    """pqcrypto is optional (the `pq` extra: its wheels need glibc >= 2.34): without it the
    agent offers what asyncssh has, and OpenSSH 9.2 falls back to X25519."""
    hidden = tmp_path / "hidden"
    (hidden / "pqcrypto").mkdir(parents=True)
    (hidden / "pqcrypto/__init__.py").write_text("raise ImportError('hidden by the test')\n")
    user.env["PYTHONPATH"] = os.pathsep.join([str(hidden), user.env["PYTHONPATH"]])
    user.up("nopq")
    result = user.ssh("-v", "nopq.devbox", "echo", "served")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"served\n"
    kex, _ = _negotiated(result.stderr)
    assert kex == "curve25519-sha256"


def test_the_agent_starts_and_serves_without_libnettle(user: User, tmp_path: Path) -> None:
    """asyncssh has UMAC only through libnettle, which a slim image may lack: the agent then
    offers the MACs it has (naming UMAC anyway made asyncssh refuse to start the server)."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(
        "import ctypes.util\n"
        "_find = ctypes.util.find_library\n"
        "ctypes.util.find_library = lambda name: None if 'nettle' in name else _find(name)\n"
    )
    user.env["PYTHONPATH"] = os.pathsep.join([str(hidden), user.env["PYTHONPATH"]])
    user.up("nonettle")
    result = user.ssh("nonettle.devbox", "echo", "served")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"served\n"
