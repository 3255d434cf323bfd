"""What the agent changes in asyncssh for bulk speed and post-quantum key exchange
(agent.sshspeed, agent.pqkex), against the real asyncssh server on loopback: the
algorithms it offers each kind of client, read off the wire; no SSH_MSG_IGNORE before every
packet; input fed in slices still parsed byte-exact; a command's wide pipes; sntrup761 as
asyncssh uses a KEM."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncssh
import pytest

from agent import pqkex
from agent.server import Agent, BoxIdentity, serve
from agent.shell import PIPE_BYTES
from agent.sshspeed import has_aes_gcm
from devbox.boxes import Multiplexer
from tests.agent.services import bare_services

GCM_ONLY = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]


@asynccontextmanager
async def _agent(tmp_path: Path) -> AsyncIterator[tuple[int, asyncssh.SSHKey]]:
    """An agent on loopback: its port and its owner's key; stopped after."""
    host_key = tmp_path / "host_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(host_key))
    owner = asyncssh.generate_private_key("ssh-ed25519")
    box = BoxIdentity(
        name="b", home=tmp_path, owner_key=owner, multiplexer=Multiplexer("none"), gpu_env=None
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = asyncio.Event()
    server = asyncio.create_task(
        serve(Agent(box, bare_services()), sock=sock, host_key=host_key, stop=stop)
    )
    try:
        yield sock.getsockname()[1], owner
    finally:
        stop.set()
        await server


async def _kexinit(port: int, version: bytes) -> dict[str, list[str]]:
    """The server's KEXINIT name-lists for a client that says `version`, read off the wire."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(version + b"\r\n")
    assert (await reader.readline()).startswith(b"SSH-2.0-")
    length, _padding = struct.unpack("!IB", await reader.readexactly(5))
    payload = await reader.readexactly(length - 1)
    writer.close()
    assert payload[0] == 20  # SSH_MSG_KEXINIT
    lists, at = [], 17  # after the type and the cookie
    for _ in range(6):  # kex, host key, cipher c->s, s->c, mac c->s, s->c
        (size,) = struct.unpack_from("!I", payload, at)
        lists.append(payload[at + 4 : at + 4 + size].decode().split(","))
        at += 4 + size
    return {"kex": lists[0], "ciphers": lists[2], "ciphers_sc": lists[3], "macs": lists[4]}


@pytest.mark.parametrize(
    ("version", "gcm"),
    [
        ("SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u10", True),
        ("SSH-2.0-OpenSSH_6.2", True),
        ("SSH-2.0-OpenSSH_for_Windows_8.1", True),
        ("SSH-2.0-OpenSSH_6.1", False),
        ("SSH-2.0-OpenSSH_5.9p1", False),
        ("SSH-2.0-paramiko_3.4.0", False),
        ("SSH-2.0-Go", False),
        ("SSH-2.0-AsyncSSH_2.24.1", False),
        (None, False),
    ],
)
def test_which_clients_are_taken_for_an_openssh_with_aes_gcm(
    version: str | None, gcm: bool
) -> None:
    assert has_aes_gcm(version) is gcm


async def test_openssh_is_offered_aes_gcm_alone_and_others_the_whole_list(
    tmp_path: Path,
) -> None:
    async with _agent(tmp_path) as (port, _):
        openssh = await _kexinit(port, b"SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u10")
        other = await _kexinit(port, b"SSH-2.0-paramiko_3.4.0")
    # OpenSSH takes the first of its own list the server has: AES-CTR if it were offered.
    assert openssh["ciphers"] == openssh["ciphers_sc"] == GCM_ONLY
    assert {"aes128-ctr", *GCM_ONLY} <= set(other["ciphers"])
    assert other["macs"][0] == "umac-128-etm@openssh.com"


async def test_sntrup761_is_offered_next_to_mlkem768(tmp_path: Path) -> None:
    async with _agent(tmp_path) as (port, _):
        kex = (await _kexinit(port, b"SSH-2.0-OpenSSH_9.2p1"))["kex"]
    assert kex[:3] == [
        "mlkem768x25519-sha256",
        "sntrup761x25519-sha512",
        "sntrup761x25519-sha512@openssh.com",
    ]
    assert "curve25519-sha256" in kex


def test_sntrup761_as_asyncssh_uses_a_kem() -> None:
    """A client's key pair, the server's encapsulation, the client's decapsulation: one
    secret, in the sizes OpenSSH's sntrup761 puts on the wire; wrong sizes are refused
    with the ValueError asyncssh turns into a protocol error."""
    client, server = pqkex.Sntrup761(b"sntrup761"), pqkex.Sntrup761(b"sntrup761")
    public = client.get_public()
    secret, ciphertext = server.encaps(public)
    assert (len(public), len(ciphertext), len(secret)) == (1158, 1039, 32)
    assert client.decaps(ciphertext) == secret
    with pytest.raises(ValueError):
        server.encaps(public[:-1])
    with pytest.raises(ValueError):
        client.decaps(ciphertext + b"x")


@asynccontextmanager
async def _packet_log() -> AsyncIterator[list[str]]:
    """The lines asyncssh logs about the packets each side sends and receives."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("asyncssh")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    asyncssh.set_debug_level(3)  # packets are logged from level 3 on
    try:
        yield lines
    finally:
        asyncssh.set_debug_level(1)
        logger.setLevel(level)
        logger.removeHandler(handler)


async def test_no_ignore_packet_before_every_data_packet(tmp_path: Path) -> None:
    """asyncssh's CBC-era countermeasure doubled the packets of a download; the agent
    offers no CBC cipher and sends none."""
    size = 256 * 1024  # eight data packets (each logged with a dump of its bytes)
    async with (
        _agent(tmp_path) as (port, owner),
        _packet_log() as lines,
        asyncssh.connect(
            "127.0.0.1", port, known_hosts=None, client_keys=[owner], username="me"
        ) as conn,
    ):
        result = await conn.run(f"head -c {size} /dev/zero", encoding=None, check=True)
    client = _context(lines, "Received exit status")
    assert result.stdout == bytes(size)
    received = [
        line
        for line in lines
        if line.startswith((f"{client}]", f"{client},")) and "Received MSG_" in line
    ]
    assert sum("MSG_CHANNEL_DATA" in line for line in received) >= size // 32768
    assert not [line for line in received if "MSG_IGNORE" in line]


def _context(lines: list[str], words: str) -> str:
    """The "[conn=N" prefix of the connection that logged `words` (the client's and the
    server's connections log to the same logger here)."""
    line = next(line for line in lines if words in line)
    return line.split(",")[0].split("]")[0]


async def test_a_large_upload_in_one_read_arrives_byte_exact(tmp_path: Path) -> None:
    """Big reads are fed to asyncssh in slices; packets cut anywhere still parse."""
    payload = os.urandom(3 * 1024 * 1024 + 12345)
    async with (
        _agent(tmp_path) as (port, owner),
        asyncssh.connect(
            "127.0.0.1", port, known_hosts=None, client_keys=[owner], username="me"
        ) as conn,
    ):
        result = await conn.run("sha256sum", input=payload, encoding=None, check=True)
    assert isinstance(result.stdout, bytes)
    assert result.stdout.split()[0].decode() == hashlib.sha256(payload).hexdigest()


async def test_a_command_reads_and_writes_wide_pipes(tmp_path: Path) -> None:
    """Its stdin and stdout are as large as the agent's reads (F_GETPIPE_SZ is 1032)."""
    sizes = "import fcntl; print(fcntl.fcntl(0, 1032), fcntl.fcntl(1, 1032))"
    async with (
        _agent(tmp_path) as (port, owner),
        asyncssh.connect(
            "127.0.0.1", port, known_hosts=None, client_keys=[owner], username="me"
        ) as conn,
    ):
        result = await conn.run(f"{sys.executable} -c '{sizes}'", check=True)
    assert result.stdout == f"{PIPE_BYTES} {PIPE_BYTES}\n"
