"""The client end of a box's probe stream (see devbox.protocol): one SSH subsystem channel
on the box's own authenticated connection; requests go up the same channel."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Sequence

from devbox import protocol
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.protocol import ProbeRequest
from devbox.ssh import frames as frames_mod
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import session

WINDOW = 256 * 1024  # as telemetry: a slow reader is felt at once and skips to the newest
_KINDS = (protocol.HELLO, protocol.PROBE_STATS, protocol.PROBE_REPLY, protocol.PROBE_GONE)


async def frames(
    conn: asyncssh.SSHClientConnection,
    box: str,
    *,
    requests: Sequence[ProbeRequest] = (),
    outbox: asyncio.Queue[ProbeRequest] | None = None,
) -> AsyncIterator[protocol.Frame]:
    """HELLO, then PROBE_STATS / PROBE_REPLY / PROBE_GONE frames until the agent ends the
    stream; an ERROR frame raises. `requests` go up at once, `outbox` ones as they come.
    A lost connection raises a DevboxError (callers need not know asyncssh)."""
    with frames_mod.lost_as_error(box, what="probe"):
        process = await conn.create_process(
            subsystem=protocol.PROBE_SUBSYSTEM, encoding=None, window=WINDOW
        )
        pump: asyncio.Task[None] | None = None
        try:
            process.stdin.write(protocol.encode(protocol.PROBE_SUBSCRIBE))
            for request in requests:
                process.stdin.write(protocol.encode(protocol.PROBE_REQUEST, **request))
            if outbox is not None:
                pump = asyncio.ensure_future(_pump(outbox, process.stdin.write))
            async for frame in frames_mod.read(process, box=box, what="probe", kinds=_KINDS):
                yield frame
        finally:
            if pump is not None:
                pump.cancel()
            process.close()


async def _pump(outbox: asyncio.Queue[ProbeRequest], write: Callable[[bytes], None]) -> None:
    while True:
        write(protocol.encode(protocol.PROBE_REQUEST, **(await outbox.get())))


def stream(
    box: Box,
    sock: socket.socket,
    *,
    requests: Sequence[ProbeRequest] = (),
    on_frame: Callable[[protocol.Frame], bool],
    timeout: float | None = None,
    waiting_for: str = "an answer",
) -> None:
    """Connect and feed frames to `on_frame` until it returns False; `timeout` bounds the
    whole exchange (None: until ctrl-c)."""

    async def follow() -> None:
        async with session(box, sock) as conn:
            async for frame in frames(conn, box.name, requests=requests):
                if not on_frame(frame):
                    return

    async def main() -> None:
        try:
            await asyncio.wait_for(follow(), timeout)
        except TimeoutError:
            raise DevboxError(f"box {box.name}: no {waiting_for} within {timeout:g} s") from None

    asyncio.run(main())
