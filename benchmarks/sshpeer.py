"""OpenSSH's sshd as a like-for-like peer of the agent: its sessions run as a throwaway Unix
user whose home is empty, so the peer's shell reads no ~/.bashrc (root's may run pyenv or
conda init, 0.1-0.2 s a command, which the agent's sessions in a sandbox home never pay),
and the key exchange and ciphers each server negotiates with the same client are read
from `ssh -v`, so a benchmark can pin the peer to the agent's or print what users meet."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import free_port, ssh_base


@dataclass(frozen=True)
class Peer:
    port: int
    pid: int  # the listener; each connection's processes are its descendants
    known_hosts: Path
    user: str  # whom the peer's sessions run as
    home_empty: bool  # False when not root: the sessions are the current user's

    def base(self, key: Path) -> list[str]:
        """The same OpenSSH client as ssh_base, logging in as the peer's user."""
        argv = ssh_base(key, self.known_hosts, self.port)
        return [*argv[:-1], "-l", self.user, argv[-1]]


@contextlib.contextmanager
def _throwaway_user() -> Iterator[tuple[str, bool]]:
    """A Unix user with an empty home, removed afterwards; the current user when not root."""
    if os.geteuid() != 0:
        import pwd

        yield pwd.getpwuid(os.getuid()).pw_name, False
        return
    name = f"dbxpeer{os.getpid()}"
    home = Path(tempfile.mkdtemp(prefix="devbox-peer-home-"))
    # "*" and not useradd's locked "!": without PAM, sshd refuses a locked account's keys.
    subprocess.run(
        ["useradd", "-M", "-d", str(home), "-s", "/bin/bash", "-U", "-p", "*", name],
        check=True,
        capture_output=True,
    )
    try:
        shutil.chown(home, name, name)
        yield name, True
    finally:
        subprocess.run(["userdel", "-f", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def sshd_peer(authorized_key: Path) -> Iterator[Peer]:
    """OpenSSH's server on loopback, accepting `authorized_key` for a throwaway user."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(binary):
        raise SystemExit("benchmark needs OpenSSH's sshd: apt-get install openssh-server")
    d = Path(tempfile.mkdtemp(prefix="devbox-peer-sshd-"))
    try:
        with _throwaway_user() as (user, home_empty):
            # The key file outside the home, which stays empty; readable by the user, as
            # sshd reads it with the user's rights.
            d.chmod(0o755)
            shutil.copy(authorized_key, d / "authorized_keys")
            (d / "authorized_keys").chmod(0o644)
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host")], check=True
            )
            port = free_port()
            (d / "config").write_text(
                f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
                f"AllowUsers {user}\nStrictModes no\nPidFile {d / 'pid'}\n"
                "Subsystem sftp internal-sftp\n"
            )
            os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
            with open(d / "log", "wb") as log:
                proc = subprocess.Popen([binary, "-D", "-e", "-f", str(d / "config")], stderr=log)
            known = d / "known_hosts"
            known.write_text(f"[127.0.0.1]:{port} {(d / 'host.pub').read_text()}")
            try:
                deadline = time.monotonic() + 10
                while True:
                    with (
                        contextlib.suppress(OSError),
                        socket.create_connection(("127.0.0.1", port)),
                    ):
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"sshd did not start: {(d / 'log').read_text()}")
                    time.sleep(0.05)
                yield Peer(port, proc.pid, known, user, home_empty)
            finally:
                proc.terminate()
                proc.wait()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass(frozen=True)
class Negotiated:
    kex: str
    cipher: str  # server -> client
    mac: str


def negotiated(base: list[str], env: dict[str, str]) -> Negotiated:
    """What OpenSSH's client and this server agree on, from `ssh -v` of one `true`."""
    done = subprocess.run(
        [*base[:-1], "-v", base[-1], "true"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
    )
    text = done.stderr.decode(errors="replace")
    kex = re.search(r"kex: algorithm: (\S+)", text)
    cipher = re.search(r"kex: server->client cipher: (\S+) MAC: (\S+)", text)
    if kex is None or cipher is None:
        raise SystemExit(f"no negotiated algorithms in ssh -v's output: {text[-800:]}")
    return Negotiated(kex.group(1), cipher.group(1), cipher.group(2))
