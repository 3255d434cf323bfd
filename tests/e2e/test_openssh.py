"""The real OpenSSH tools against the agent, through `devbox ssh-config` and `devbox proxy`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import User
from tests.e2e.helpers import impostor_agent

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")


def test_ssh_config_blocks_and_include_are_idempotent(user: User) -> None:
    ssh_dir = user.home / ".ssh"
    ssh_dir.mkdir()
    original = "Host example\n  User someone\n"
    (ssh_dir / "config").write_text(original)
    user.up("cfg")
    printed = user.devbox("ssh-config", check=True).stdout.decode()
    assert "Host cfg.devbox" in printed and "proxy --backend local cfg" in printed
    assert "HostKeyAlias cfg.devbox" in printed and "StrictHostKeyChecking yes" in printed

    for _ in range(2):
        user.devbox("ssh-config", "--write", check=True)
    text = (ssh_dir / "config").read_text()
    include = f"Include {user.ssh_config}"
    assert text.splitlines()[0] == include and text.count(include) == 1
    assert text.endswith(original)  # nothing else touched
    assert user.ssh_config.read_text() == printed
    # Once written, up and down keep the managed file current.
    user.up("later")
    assert "Host later.devbox" in user.ssh_config.read_text()
    user.devbox("down", "later", check=True)
    assert "Host later.devbox" not in user.ssh_config.read_text()


def test_ssh_scp_sftp_rsync(user: User, tmp_path: Path) -> None:
    user.up("tools")
    result = user.ssh("tools.devbox", "echo $DEVBOX_BOX; pwd")
    assert result.returncode == 0, result.stderr
    name, cwd = result.stdout.decode().split()
    assert name == "tools" and cwd == str(user.home)  # as under sshd: the session's $HOME
    assert user.ssh("tools.devbox", "exit 9").returncode == 9

    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(3 << 20))
    cfg = ["-F", str(user.ssh_config)]
    subprocess.run(
        ["scp", *cfg, str(payload), "tools.devbox:copied.bin"],
        env=user.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    home = user.home
    assert (home / "copied.bin").read_bytes() == payload.read_bytes()
    back = tmp_path / "back.bin"
    subprocess.run(
        ["scp", *cfg, "tools.devbox:copied.bin", str(back)],
        env=user.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert back.read_bytes() == payload.read_bytes()

    batch = f"mkdir sub\nput {payload} sub/p.bin\nls sub\n"
    sftp = subprocess.run(
        ["sftp", *cfg, "-b", "-", "tools.devbox"],
        input=batch.encode(),
        env=user.env,
        capture_output=True,
        timeout=60,
    )
    assert sftp.returncode == 0, sftp.stderr
    assert (home / "sub/p.bin").read_bytes() == payload.read_bytes()

    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    tree = tmp_path / "tree"
    (tree / "a/b").mkdir(parents=True)
    (tree / "a/b/file.txt").write_text("rsynced")
    rsync = subprocess.run(
        ["rsync", "-a", "-e", f"ssh {' '.join(cfg)}", f"{tree}/", "tools.devbox:tree/"],
        env=user.env,
        capture_output=True,
        timeout=60,
    )
    assert rsync.returncode == 0, rsync.stderr
    assert (home / "tree/a/b/file.txt").read_text() == "rsynced"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _echo_server() -> tuple[int, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"echo:" + conn.recv(100))

    threading.Thread(target=serve, daemon=True).start()
    return int(srv.getsockname()[1]), srv


def _roundtrip(port: int, deadline: float) -> bytes:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"ping")
                data = c.recv(100)
                if data:
                    return data
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing answered on port {port}")
        time.sleep(0.1)


def _tunnel(user: User, *args: str) -> subprocess.Popen[bytes]:
    """`ssh -N` holding forwards open, through the generated config."""
    return subprocess.Popen(
        ["ssh", "-F", str(user.ssh_config), "-N", "-o", "ExitOnForwardFailure=yes", *args],
        env=user.env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("direction", ["-L", "-R"])
def test_port_forwarding(user: User, direction: str) -> None:
    user.up("fwd")
    user.devbox("ssh-config", "--write", check=True)
    target, srv = _echo_server()
    listen = _free_port()
    tunnel = _tunnel(user, direction, f"{listen}:127.0.0.1:{target}", "fwd.devbox")
    try:
        assert _roundtrip(listen, time.monotonic() + 15) == b"echo:ping"
    finally:
        tunnel.send_signal(signal.SIGTERM)
        tunnel.wait(timeout=10)
        srv.close()


def test_a_foreign_key_is_refused(user: User, tmp_path: Path, ssh_client: str) -> None:
    user.up("mine")
    user.devbox("ssh-config", "--write", check=True)
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = user.ssh_config.read_text().replace(
        str(user.home / ".config/devbox/id_ed25519"), str(stranger)
    )
    other = tmp_path / "stranger_config"
    other.write_text(config)
    refused = subprocess.run(
        ["ssh", "-F", str(other), "mine.devbox", "true"],
        env=user.env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=30,
    )
    assert refused.returncode == 255
    assert b"Permission denied (publickey)" in refused.stderr

    # devbox's own client, with the user's key swapped for a stranger's.
    key = user.home / ".config/devbox/id_ed25519"
    shutil.copy(stranger, key)
    shutil.copy(f"{stranger}.pub", f"{key}.pub")
    ours = user.devbox("ssh", "mine", "--", "true")
    assert ours.returncode == 1
    assert ours.stderr.decode() == f"devbox: error: box mine refused your key {key}\n"


def test_a_changed_host_key_is_refused(user: User, tmp_path: Path, ssh_client: str) -> None:
    user.up("pinned")
    user.devbox("ssh-config", "--write", check=True)
    # An impostor answers on the box's address with another host key.
    with impostor_agent(user, "pinned", tmp_path):
        openssh = user.ssh("pinned.devbox", "true")
        assert openssh.returncode == 255
        assert b"Host key verification failed" in openssh.stderr
        ours = user.devbox("ssh", "pinned", "--", "true")
        assert ours.returncode == 1
        assert ours.stderr.decode().startswith(
            "devbox: error: box pinned presented a host key that does not match the pinned"
        )


def test_a_shell_on_stdin_without_a_pty(user: User) -> None:
    """What VS Code Remote-SSH does first: `ssh -T host bash` fed a script on stdin."""
    user.up("vscode")
    result = user.ssh("-T", "vscode.devbox", input=b"uname -s\necho box=$DEVBOX_BOX\nexit 3\n")
    assert result.returncode == 3, result.stderr
    assert result.stdout.decode().split() == ["Linux", "box=vscode"]
    dynamic_port = _free_port()
    target, srv = _echo_server()
    socks = _tunnel(user, "-D", str(dynamic_port), "vscode.devbox")
    try:
        # A SOCKS5 CONNECT to the echo server through ssh -D (VS Code's dynamic forward).
        deadline = time.monotonic() + 15
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", dynamic_port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with c:
            c.sendall(b"\x05\x01\x00")
            assert c.recv(2) == b"\x05\x00"
            c.sendall(
                b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + target.to_bytes(2, "big")
            )
            assert c.recv(10)[:2] == b"\x05\x00"
            c.sendall(b"hi")
            assert c.recv(100) == b"echo:hi"
    finally:
        socks.terminate()
        socks.wait(timeout=10)
        srv.close()


def test_one_backend_keeps_the_other_backends_aliases(user: User) -> None:
    user.devbox("ssh-config", "--write", check=True)
    other = (
        "\nHost remote.devbox\n  User me\n"
        "  ProxyCommand python -m devbox proxy --backend kubernetes remote --namespace lab\n"
    )
    with user.ssh_config.open("a") as f:
        f.write(other)
    user.up("here")
    text = user.ssh_config.read_text()
    assert "Host here.devbox" in text and "Host remote.devbox" in text
    user.devbox("down", "here", check=True)
    text = user.ssh_config.read_text()
    assert "Host here.devbox" not in text and "--backend kubernetes remote" in text
