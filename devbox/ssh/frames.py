"""Reading an agent subsystem's frame stream (telemetry, probe): one place decides what a
malformed line, an ERROR frame and a closed channel mean."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection, Iterator

from devbox import protocol
from devbox.errors import DevboxError
from devbox.ssh._asyncssh import asyncssh


async def read(
    process: asyncssh.SSHClientProcess[bytes], *, box: str, what: str, kinds: Collection[str]
) -> AsyncIterator[protocol.Frame]:
    """Frames of `kinds` until the agent ends the stream, which raises with what it said on
    stderr (an older agent without the subsystem says so there). An ERROR frame raises;
    other types (HELLO, types newer than this client) are skipped."""
    while line := await process.stdout.readline():
        try:
            frame = protocol.decode(line)
        except protocol.ProtocolError as exc:
            raise DevboxError(f"box {box} sent a malformed {what} frame: {exc}") from None
        if frame.type == protocol.ERROR:
            raise DevboxError(f"box {box}: {frame.body.get('message', f'{what} failed')}")
        if frame.type in kinds:
            yield frame
    err = (await process.stderr.read()).decode(errors="replace").strip()
    raise DevboxError(f"box {box} ended the {what} stream" + (f": {err}" if err else ""))


@contextlib.contextmanager
def lost_as_error(box: str, *, what: str) -> Iterator[None]:
    """asyncssh's errors of a stream as devbox's one-line DevboxError: the dashboard's
    workers then see a box whose agent died as a lost link to retry, not a crash."""
    try:
        yield
    except asyncssh.ChannelOpenError as exc:
        raise DevboxError(f"box {box} refused the {what} stream: {exc.reason}") from None
    except asyncssh.Error as exc:
        raise DevboxError(f"lost the connection to box {box}: {exc.reason}") from None
    except (OSError, EOFError) as exc:
        reason = str(exc) or type(exc).__name__
        raise DevboxError(f"lost the connection to box {box}: {reason}") from None
