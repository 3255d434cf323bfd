"""The agent against strangers: the cap on unauthenticated connections and whom it evicts,
the kernel's word on who a loopback peer is, the login grace time, logs that a flood
cannot grow and that hold no command line, strict key exchange, and paramiko. The real
asyncssh server on loopback, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncssh
import paramiko
import pytest

from agent import preauth
from agent.server import Agent, BoxIdentity, serve
from devbox.boxes import Multiplexer
from tests.agent.services import bare_services


class _Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_the_peer_holding_most_loses_its_oldest_idle_connection() -> None:
    tally = preauth.Tally()
    gate = preauth.Gate(tally, limit=4)
    flood = [_Conn(f"f{i}") for i in range(3)]
    for conn in flood:
        gate.admit(conn, "uid 1001")
    owner = _Conn("owner")
    gate.admit(owner, "uid 1000")
    gate.asked(owner)
    # A fifth from the flood: its own oldest goes, the owner's stays.
    more = _Conn("f3")
    gate.admit(more, "uid 1001")
    assert flood[0].aborted and not owner.aborted and len(gate) == 4
    # The flood past key exchange on one connection: that one outlives its idle ones.
    gate.asked(flood[1])
    gate.admit(_Conn("f4"), "uid 1001")
    assert flood[2].aborted and not flood[1].aborted
    # A newcomer from a third peer is taken too, at the flood's cost again.
    stranger = _Conn("s")
    gate.admit(stranger, "10.0.0.7")
    assert more.aborted and not owner.aborted and not stranger.aborted
    gate.authenticated(owner)
    assert len(gate) == 3


def test_even_sharing_a_peer_the_owner_past_key_exchange_outlives_a_flood() -> None:
    gate = preauth.Gate(preauth.Tally(), limit=8)
    owner = _Conn("owner")
    gate.admit(owner, "loopback")
    gate.asked(owner)
    flood = [_Conn(str(i)) for i in range(100)]
    for conn in flood:
        gate.admit(conn, "loopback")
    assert not owner.aborted and sum(c.aborted for c in flood) == 100 - 7


def test_the_kernel_names_the_user_of_a_loopback_peer() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()):
            accepted, peer = server.accept()
            with accepted:
                local = accepted.getsockname()
                assert preauth.socket_uid(peer[0], peer[1], local[0], local[1]) == os.getuid()
                assert preauth.peer_of(peer, local) == f"uid {os.getuid()}"
                assert preauth.peer_of(("::ffff:127.0.0.1", peer[1]), local) == (
                    f"uid {os.getuid()}"
                )
            # No such socket: no uid, rather than someone else's.
            assert preauth.socket_uid("127.0.0.1", 1, local[0], local[1]) is None
    # A peer that is not local is its address, whatever it says of itself.
    assert preauth.peer_of(("10.1.2.3", 4000), ("10.1.2.4", 22)) == "10.1.2.3"
    assert preauth.peer_of(None, None) == "unknown"


async def test_a_flood_of_refusals_is_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="devbox.agent")
    tally = preauth.Tally(interval=0.2, details=2)
    for i in range(5000):
        tally.note("keys refused", "uid 1001", f"refused key SHA256:k{i}")
        tally.note("closed", "uid 1001")
    await _until(lambda: any("unauthenticated" in r.message for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # two details, one summary
    assert lines[-1] == (
        "unauthenticated connections in the last 0 s: 5000 keys refused, 5000 closed; "
        "most from uid 1001 (10000)"
    )
    tally.close()  # nothing since: nothing more
    assert len(caplog.records) == 3


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """tests/waiting.py's wait_until, for a test whose agent runs on its own event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _agent(
    tmp_path: Path, *, grace: float = preauth.LOGIN_GRACE, interval: float = 60.0
) -> AsyncIterator[tuple[int, asyncssh.SSHKey]]:
    """An agent on loopback: its port and its owner's key; stopped after."""
    host_key = tmp_path / "host_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(host_key))
    owner = asyncssh.generate_private_key("ssh-ed25519")
    box = BoxIdentity(
        name="b", home=tmp_path, owner_key=owner, multiplexer=Multiplexer("none"), gpu_env=None
    )
    running = Agent(box, bare_services())
    running.preauth_log = preauth.Tally(interval=interval)
    running.gate = preauth.Gate(running.preauth_log, grace=grace)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = asyncio.Event()
    server = asyncio.create_task(serve(running, sock=sock, host_key=host_key, stop=stop))
    try:
        yield sock.getsockname()[1], owner
    finally:
        stop.set()
        await server


async def test_refused_keys_are_counted_and_logs_hold_no_command(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="devbox.agent")
    strangers = [asyncssh.generate_private_key("ssh-ed25519") for _ in range(8)]
    secret = "TOKEN=s3cr3t-value"
    # One interval for the whole test: the summary is the one written at shutdown.
    async with _agent(tmp_path) as (port, owner):
        for key in strangers:
            with pytest.raises(asyncssh.PermissionDenied):
                await asyncssh.connect(
                    "127.0.0.1", port, known_hosts=None, client_keys=[key], username="x" * 500
                )
        async with asyncssh.connect(
            "127.0.0.1", port, known_hosts=None, client_keys=[owner], username="me"
        ) as conn:
            assert (await conn.run(f"{secret} true", check=True)).exit_status == 0
    lines = [r.getMessage() for r in caplog.records]
    refusals = [line for line in lines if line.startswith("refused key")]
    assert len(refusals) == preauth.DETAILS_PER_INTERVAL
    assert f"for {'x' * 32!r}: not the owner's (uid {os.getuid()})" in refusals[0]
    summary = [line for line in lines if line.startswith("unauthenticated connections")]
    assert len(summary) == 1 and "8 keys refused, 8 closed" in summary[0], lines
    assert "session: exec (23 bytes)" in lines
    assert "s3cr3t" not in "\n".join(lines) and "x" * 33 not in "\n".join(lines)


async def test_a_silent_connection_is_dropped_after_the_grace_time(tmp_path: Path) -> None:
    async with _agent(tmp_path, grace=0.5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await reader.readline()).startswith(b"SSH-2.0-")
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(reader.read(), timeout=10)  # EOF: the server dropped it
        assert asyncio.get_running_loop().time() - started >= 0.4
        writer.close()


async def test_strict_key_exchange_is_offered(tmp_path: Path) -> None:
    """The server's KEXINIT, read off the wire: kex-strict-s-v00@openssh.com (Terrapin)."""
    async with _agent(tmp_path) as (port, _):
        payload = await _kexinit(port)
    assert payload[0] == 20  # SSH_MSG_KEXINIT
    (size,) = struct.unpack_from("!I", payload, 17)  # after the type and the cookie
    kex = payload[21 : 21 + size].decode().split(",")
    assert "kex-strict-s-v00@openssh.com" in kex
    assert "curve25519-sha256" in kex
    assert not [alg for alg in kex if "sha1" in alg or "nistp" in alg or "group" in alg]


async def _kexinit(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"SSH-2.0-probe\r\n")
    assert (await reader.readline()).startswith(b"SSH-2.0-")
    length, _padding = struct.unpack("!IB", await reader.readexactly(5))
    payload = await reader.readexactly(length - 1)
    writer.close()
    return payload


async def test_paramiko_connects(tmp_path: Path) -> None:
    async with _agent(tmp_path) as (port, owner):
        out, cipher = await asyncio.to_thread(_paramiko_echo, port, owner)
    assert out == b"paramiko\n" and cipher.startswith("aes")


def _paramiko_echo(port: int, owner: asyncssh.SSHKey) -> tuple[bytes, str]:
    key = paramiko.Ed25519Key.from_private_key(io.StringIO(owner.export_private_key().decode()))
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    try:
        client.connect(
            "127.0.0.1", port, username="me", pkey=key, allow_agent=False, look_for_keys=False
        )
        _, stdout, _ = client.exec_command("echo paramiko")
        transport = client.get_transport()
        assert transport is not None
        return stdout.read(), transport.remote_cipher
    finally:
        client.close()
