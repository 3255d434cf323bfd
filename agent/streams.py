"""What every frame stream the agent serves (telemetry, probe) shares: reading a
subscriber's newline-delimited requests with a bound, and ending a stream with one ERROR frame."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from devbox import protocol

# A request line longer than this is malformed: it bounds what one client can make us buffer.
MAX_REQUEST_BYTES = 64 * 1024


class RequestError(Exception):
    """A subscriber's request that cannot be served; it gets one ERROR frame."""


def fail(write: Callable[[bytes], None], message: str) -> int:
    """End a stream with one ERROR frame; the channel's exit status."""
    write(protocol.encode(protocol.ERROR, message=message))
    return 1


class LineReader:
    """Newline-delimited frames from a byte stream, each at most MAX_REQUEST_BYTES."""

    def __init__(self, read: Callable[[int], Awaitable[bytes]]) -> None:
        self._read = read
        self._buf = b""

    async def next(self) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_REQUEST_BYTES:
                raise RequestError(f"request longer than {MAX_REQUEST_BYTES} bytes")
            chunk = await self._read(4096)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        if len(line) > MAX_REQUEST_BYTES:
            raise RequestError(f"request longer than {MAX_REQUEST_BYTES} bytes")
        return line
