"""The client end of a box's telemetry stream (see devbox.protocol): one SSH subsystem
channel on the box's own authenticated connection."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

from devbox import protocol
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import connect

# A telemetry channel needs no large window: a small one makes the agent feel a slow
# reader at once (it then skips to the newest sample) instead of filling megabytes.
WINDOW = 256 * 1024


async def frames(
    conn: asyncssh.SSHClientConnection, box: str, *, rate: float, history: bool
) -> AsyncIterator[protocol.Frame]:
    """HISTORY and SAMPLE frames until the agent ends the stream; an ERROR frame raises."""
    process = await conn.create_process(
        subsystem=protocol.TELEMETRY_SUBSYSTEM, encoding=None, window=WINDOW
    )
    try:
        process.stdin.write(protocol.encode(protocol.SUBSCRIBE, rate=rate, history=history))
        while line := await process.stdout.readline():
            try:
                frame = protocol.decode(line)
            except protocol.ProtocolError as exc:
                raise DevboxError(f"box {box} sent a malformed telemetry frame: {exc}") from None
            if frame.type == protocol.ERROR:
                raise DevboxError(f"box {box}: {frame.body.get('message', 'telemetry failed')}")
            if frame.type in (protocol.HISTORY, protocol.SAMPLE):
                yield frame  # HELLO and types newer than this client are skipped
        # The channel closed without an ERROR frame: an agent without telemetry says so
        # on stderr (an older agent), or the box went away.
        err = (await process.stderr.read()).decode(errors="replace").strip()
        raise DevboxError(f"box {box} ended the telemetry stream" + (f": {err}" if err else ""))
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
        conn = await connect(box, sock)
        try:
            async for frame in frames(conn, box.name, rate=rate, history=history):
                if not on_frame(frame):
                    return
        finally:
            conn.close()

    try:
        asyncio.run(main())
    except (asyncssh.ConnectionLost, asyncssh.DisconnectError) as exc:
        raise DevboxError(f"lost the connection to box {box.name}: {exc.reason}") from None
    except asyncssh.ChannelOpenError as exc:
        raise DevboxError(f"box {box.name} refused the telemetry stream: {exc.reason}") from None
