"""A claimer connects as soon as its claim is written, often before the agent's pod watch
has brought the new owner: the agent then reads its pod once for that connection, and takes
the key if the pod names it now. The real asyncssh server and client, on loopback."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import asyncssh
import pytest

from agent.server import Agent, BoxIdentity, serve
from devbox.boxes import Multiplexer
from tests.agent.services import bare_services


async def _try(
    tmp_path: Path, key: asyncssh.SSHKey, *, names_the_key: bool
) -> tuple[bool, int, BoxIdentity]:
    host_key = tmp_path / "host_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(host_key))
    box = BoxIdentity(
        name="b", home=tmp_path, owner_key=None, multiplexer=Multiplexer("none"), gpu_env=None
    )
    reads = 0

    async def refresh_owner() -> None:  # what the in-cluster agent does: read the pod
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)  # an API round trip
        if names_the_key:
            box.owner_key = key

    agent = Agent(box, bare_services(), refresh_owner=refresh_owner)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    stop = asyncio.Event()
    server = asyncio.create_task(serve(agent, sock=sock, host_key=host_key, stop=stop))
    try:
        # Two keys offered, the claimer's last (as OpenSSH offers its agent's keys first):
        # the pod is still read once only.
        other = asyncssh.generate_private_key("ssh-ed25519")
        async with asyncssh.connect(
            "127.0.0.1", port, known_hosts=None, client_keys=[other, key], username="u"
        ) as conn:
            result = await conn.run("echo hi", check=True)
            assert result.stdout == "hi\n"
        return True, reads, box
    except asyncssh.PermissionDenied:
        return False, reads, box
    finally:
        stop.set()
        await server


def test_a_key_the_pod_names_now_is_taken_at_once(tmp_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    accepted, reads, box = asyncio.run(_try(tmp_path, key, names_the_key=True))
    assert accepted and reads == 1
    assert box.owner_key is not None and box.owner_key.public_data == key.public_data


def test_a_key_the_pod_does_not_name_is_refused(tmp_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    accepted, reads, box = asyncio.run(_try(tmp_path, key, names_the_key=False))
    assert not accepted and reads == 1 and box.owner_key is None


@pytest.mark.parametrize("home_is_home", [True, False])
def test_in_a_pod_the_persistent_home_is_home(tmp_path: Path, home_is_home: bool) -> None:
    box = BoxIdentity(
        name="b",
        home=tmp_path,
        owner_key=None,
        multiplexer=Multiplexer("none"),
        gpu_env=None,
        home_is_home=home_is_home,
    )

    class Channel:  # what session_env reads of an SSH channel
        env: dict[str, str] = {}

        def get_extra_info(self, name: str) -> None:
            return None

        def get_terminal_type(self) -> None:
            return None

    env = Agent(box, bare_services()).session_env(Channel())  # type: ignore[arg-type]
    assert (env["HOME"] == str(tmp_path)) is home_is_home
