"""The client end of a box's telemetry stream (see devbox.protocol): one SSH subsystem
channel on the box's own authenticated connection."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

from devbox import protocol
from devbox.boxes import Box
from devbox.ssh import frames as frames_mod
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import session

# A telemetry channel needs no large window: a small one makes the agent feel a slow
# reader at once (it then skips to the newest sample) instead of filling megabytes.
WINDOW = 256 * 1024


async def frames(
    conn: asyncssh.SSHClientConnection, box: str, *, rate: float, history: bool
) -> AsyncIterator[protocol.Frame]:
    """HISTORY and SAMPLE frames until the agent ends the stream; an ERROR frame raises,
    and so does a lost connection, as a DevboxError (callers need not know asyncssh)."""
    with frames_mod.lost_as_error(box, what="telemetry"):
        process = await conn.create_process(
            subsystem=protocol.TELEMETRY_SUBSYSTEM, encoding=None, window=WINDOW
        )
        try:
            process.stdin.write(protocol.encode(protocol.SUBSCRIBE, rate=rate, history=history))
            kinds = (protocol.HISTORY, protocol.SAMPLE)
            async for frame in frames_mod.read(process, box=box, what="telemetry", kinds=kinds):
                yield frame
        finally:
            process.close()


def stream(
    box: Box,
    sock: socket.socket,
    *,
    rate: float,
    history: bool,
    on_frame: Callable[[protocol.Frame], bool],
) -> None:
    """Connect and feed frames to `on_frame` until it returns False."""

    async def main() -> None:
        async with session(box, sock) as conn:
            async for frame in frames(conn, box.name, rate=rate, history=history):
                if not on_frame(frame):
                    return

    asyncio.run(main())
