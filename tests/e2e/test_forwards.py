"""Port forwarding with the real OpenSSH client, as against sshd: -L, -D, -W, -L to a Unix
socket, -R (on loopback whatever address it asks for) and -R to a Unix socket; and the
client's traffic through them, past the floor, reported as the box's `last_forward`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import select
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from devbox import protocol
from devbox.backends.local.store import BoxStore
from tests.conftest import User
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")

_ALLOCATED = re.compile(r"Allocated port (\d+) for remote forward to (\S+)")
# Past the floor whatever the window: what an editor's session sends in a few seconds.
BULK = 16 * protocol.TRAFFIC_FLOOR


def _echo(conn: socket.socket) -> None:
    """Echoes until the client's EOF, then closes: the reply's end is the box's EOF."""
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


@contextlib.contextmanager
def _server(
    family: socket.AddressFamily,
    address: str | tuple[str, int],
    handle: Callable[[socket.socket], None] = _echo,
) -> Iterator[Any]:
    """A server in the box (this machine), one thread per connection; its address."""
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.bind(address)
    srv.listen()

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield srv.getsockname()
    finally:
        srv.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _ssh(user: User, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`ssh -N` holding forwards open, through the generated config."""
    user.devbox("ssh-config", "--write", check=True)
    proc = subprocess.Popen(
        ["ssh", "-F", str(user.ssh_config), "-N", "-o", "ExitOnForwardFailure=yes", *args],
        env=user.env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _connect(family: socket.AddressFamily, address: str | tuple[str, int]) -> socket.socket:
    def attempt() -> socket.socket | None:
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.connect(address)
        except OSError:
            s.close()
            return None
        return s

    sock: socket.socket = wait_until(attempt, timeout=20, what=f"a listener on {address}")
    sock.settimeout(30)
    return sock


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    """Sends `payload` and EOF, and reads the reply to the server's EOF."""
    with sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def _tcp_roundtrip(port: int, payload: bytes) -> None:
    assert _exchange(_connect(socket.AF_INET, ("127.0.0.1", port)), payload) == payload


def _last_forward(user: User, box: str) -> float:
    report, _ = BoxStore(user.state / "local").activity_report(box)
    return report.get("last_forward", 0.0) if report is not None else 0.0


def _counted_after(user: User, box: str, since: float) -> None:
    wait_until(lambda: _last_forward(user, box) >= since, timeout=20, what="last_forward moved")


def _rewritten_twice(user: User, box: str) -> None:
    """The agent rewrote its activity file twice since now: what it knew now is in it."""
    path = user.box_dir(box) / "activity.json"

    def written() -> int:
        with contextlib.suppress(FileNotFoundError):
            return path.stat().st_mtime_ns
        return 0  # not written yet: the agent's sampler starts after its first connection

    for _ in range(2):
        before = written()

        def rewritten(before: int = before) -> bool:
            return written() != before

        wait_until(rewritten, timeout=20, what="a rewrite")


def test_local_forward_counts_past_the_floor_and_not_a_trickle(user: User) -> None:
    user.up("fwd")
    with _server(socket.AF_INET, ("127.0.0.1", 0)) as (_, target):
        listen = _free_port()
        with _ssh(user, "-L", f"{listen}:127.0.0.1:{target}", "fwd.devbox"):
            # Keepalive-like chatter: a few small exchanges, under the floor in all.
            for _ in range(3):
                _tcp_roundtrip(listen, b"x" * 200)
            _rewritten_twice(user, "fwd")
            assert _last_forward(user, "fwd") == 0.0
            since = time.time()
            _tcp_roundtrip(listen, os.urandom(BULK))
            _counted_after(user, "fwd", since)


def test_a_bulk_stream_both_ways_arrives_whole(user: User) -> None:
    """More than every window and buffer on the way, sent while the echo comes back."""
    user.up("bulk")
    payload = os.urandom(48 << 20)
    with _server(socket.AF_INET, ("127.0.0.1", 0)) as (_, target):
        listen = _free_port()
        with _ssh(user, "-L", f"{listen}:127.0.0.1:{target}", "bulk.devbox"):
            sock = _connect(socket.AF_INET, ("127.0.0.1", listen))
            digest = hashlib.sha256()
            received = 0

            def read() -> None:
                nonlocal received
                while data := sock.recv(1 << 20):
                    digest.update(data)
                    received += len(data)

            reader = threading.Thread(target=read)
            reader.start()
            with sock:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                reader.join(timeout=120)
            assert received == len(payload)
            assert digest.digest() == hashlib.sha256(payload).digest()


def test_the_box_can_end_its_side_first(user: User) -> None:
    """A server that says its piece and shuts its side keeps reading what the client sends."""
    user.up("half")
    heard: list[bytes] = []

    def greet(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"hello")
            conn.shutdown(socket.SHUT_WR)
            chunks = []
            while data := conn.recv(65536):
                chunks.append(data)
            heard.append(b"".join(chunks))

    with _server(socket.AF_INET, ("127.0.0.1", 0), greet) as (_, target):
        listen = _free_port()
        with _ssh(user, "-L", f"{listen}:127.0.0.1:{target}", "half.devbox"):
            sock = _connect(socket.AF_INET, ("127.0.0.1", listen))
            with sock:
                greeting = b""
                while data := sock.recv(100):  # to the box's EOF
                    greeting += data
                assert greeting == b"hello"
                payload = os.urandom(BULK)
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                assert sock.recv(100) == b""
            wait_until(lambda: heard, timeout=20, what="the server's EOF")
            assert heard == [payload]


def test_socks_forward_works_and_counts(user: User) -> None:
    user.up("socks")
    with _server(socket.AF_INET, ("127.0.0.1", 0)) as (_, target):
        dynamic = _free_port()
        with _ssh(user, "-D", str(dynamic), "socks.devbox"):
            since = time.time()
            sock = _connect(socket.AF_INET, ("127.0.0.1", dynamic))
            sock.sendall(b"\x05\x01\x00")
            assert sock.recv(2) == b"\x05\x00"
            address = socket.inet_aton("127.0.0.1") + target.to_bytes(2, "big")
            sock.sendall(b"\x05\x01\x00\x01" + address)
            assert sock.recv(10)[:2] == b"\x05\x00"
            payload = os.urandom(BULK)
            assert _exchange(sock, payload) == payload
            _counted_after(user, "socks", since)


def test_local_forward_to_a_unix_socket_works_and_counts(user: User, short_tmp: Path) -> None:
    user.up("unix")
    path = short_tmp / "echo.sock"
    with _server(socket.AF_UNIX, str(path)):
        listen = _free_port()
        with _ssh(user, "-L", f"{listen}:{path}", "unix.devbox"):
            since = time.time()
            _tcp_roundtrip(listen, os.urandom(BULK))
            _counted_after(user, "unix", since)


def test_a_refused_destination_fails_the_open_as_sshd(user: User) -> None:
    user.up("refused")
    closed = _free_port()
    result = user.ssh("-W", f"127.0.0.1:{closed}", "refused.devbox")
    assert result.returncode == 255
    assert b"open failed: connect failed: Connection refused" in result.stderr


def _allocated(proc: subprocess.Popen[bytes], count: int) -> dict[str, int]:
    """What `ssh -R 0:...` says it got: {"host:port" forwarded to: the box's port}."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()  # read raw: a buffered readline would hide lines from select
    said = b""
    deadline = time.monotonic() + 30
    while True:
        found = {m[2]: int(m[1]) for m in _ALLOCATED.finditer(said.decode())}
        if len(found) >= count:
            return found
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"ssh said only {said!r}"
        data = os.read(fd, 4096)
        assert data, f"ssh ended ({proc.wait()}): {said!r}"
        said += data


def _listening_hosts(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def test_remote_forward_listens_on_loopback_whatever_it_asks(user: User) -> None:
    user.up("rfwd")
    with contextlib.ExitStack() as stack:
        targets = [
            stack.enter_context(_server(socket.AF_INET, ("127.0.0.1", 0)))[1] for _ in range(3)
        ]
        asks = [f"0.0.0.0:0:127.0.0.1:{targets[0]}", f"*:0:127.0.0.1:{targets[1]}"]
        asks.append(f"0:127.0.0.1:{targets[2]}")
        args = [a for ask in asks for a in ("-R", ask)]
        proc = stack.enter_context(_ssh(user, *args, "rfwd.devbox"))
        ports = _allocated(proc, 3)
        assert sorted(ports) == sorted(f"127.0.0.1:{t}" for t in targets)
        since = time.time()
        for port in ports.values():
            hosts = _listening_hosts(port)
            assert "127.0.0.1" in hosts and hosts <= {"127.0.0.1", "::1"}, hosts
            # What the client's side sends back into the box counts as its traffic.
            _tcp_roundtrip(port, os.urandom(BULK))
        _counted_after(user, "rfwd", since)


def test_remote_forward_to_a_unix_socket(user: User, short_tmp: Path) -> None:
    user.up("rsock")
    path = short_tmp / "box.sock"
    # What a forward whose agent was killed leaves: a socket file nobody listens on.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    with _server(socket.AF_INET, ("127.0.0.1", 0)) as (_, target):
        with _ssh(user, "-R", f"{path}:127.0.0.1:{target}", "rsock.devbox") as proc:
            payload = os.urandom(BULK)
            assert _exchange(_connect(socket.AF_UNIX, str(path)), payload) == payload
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            # A socket in use is never taken over: a second forward to it fails.
            second = user.ssh(
                "-N",
                "-o",
                "ExitOnForwardFailure=yes",
                "-R",
                f"{path}:127.0.0.1:{target}",
                "rsock.devbox",
            )
            assert second.returncode == 255
            assert b"remote port forwarding failed" in second.stderr
            assert proc.poll() is None
        # The forward's end removes its socket.
        wait_until(lambda: not path.exists(), timeout=20, what="the socket removed")
