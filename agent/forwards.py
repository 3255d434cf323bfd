"""Port forwarding as sshd does it: `ssh -L`, `-D` and `-W` (direct-tcpip) and `-L` to a Unix
socket (direct-streamlocal) here; `-R` in agent.remoteforwards, with the same Relay.

The agent relays every forwarded connection itself instead of leaving it to asyncssh, so
that what the client sends through it counts as activity ("forward"): VS Code's whole
session, its server connection, its terminals and the ports it forwards, runs through
such forwards, and a box in use must not look idle and be released."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Callable
from typing import Any

import asyncssh

from agent.activity import Activity

Count = Callable[[int], None]


class Relay(asyncssh.SSHTCPSession[bytes], asyncssh.SSHUNIXSession[bytes]):
    """One forwarded connection: the session of its SSH channel, and (`protocol`) the asyncio
    protocol of its socket in the box. Each side pauses the other when its buffer is full;
    an EOF passes through either way; the socket is not read until the channel is open."""

    def __init__(
        self, count: Count, *, on_connect: Callable[[Relay, asyncio.Transport], None] | None = None
    ) -> None:
        self._count = count
        self._on_connect = on_connect
        self._chan: Any = None  # an SSHTCPChannel or SSHUNIXChannel, once open
        self._sock: asyncio.Transport | None = None
        self._started = False
        self._chan_full = False
        self._client_eof = False
        self._box_eof = False
        self._box_closed = False
        self.protocol = _BoxSide(self)

    # --- the SSH channel --------------------------------------------------------------

    def connection_made(self, chan: Any) -> None:
        self._chan = chan

    def session_started(self) -> None:
        self._started = True
        if self._box_closed:  # the box's side ended before the client's was open
            self._chan.close()
        self._read_box()

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        self._count(len(data))  # the client -> box direction: what a user's tools send
        sock = self._sock
        if sock is not None and not sock.is_closing():
            sock.write(data)

    def eof_received(self) -> bool:
        self._client_eof = True
        sock = self._sock
        if sock is not None and not sock.is_closing():
            if self._box_eof:
                sock.close()  # both ways done (what is buffered is still written)
            else:
                with contextlib.suppress(OSError):  # reset meanwhile: connection_lost follows
                    sock.write_eof()
        return True  # the channel stays open for what the box still sends

    def pause_writing(self) -> None:
        self._chan_full = True
        self._read_box()

    def resume_writing(self) -> None:
        self._chan_full = False
        self._read_box()

    def connection_lost(self, exc: Exception | None) -> None:
        self._chan = None
        if self._sock is not None:
            self._sock.close()

    # --- the socket in the box (called by _BoxSide) -----------------------------------

    def _read_box(self) -> None:
        sock = self._sock
        if sock is None or sock.is_closing() or self._box_eof:
            return
        if self._started and not self._chan_full:
            sock.resume_reading()
        else:
            sock.pause_reading()

    def _box_connected(self, transport: asyncio.Transport) -> None:
        self._sock = transport
        self._read_box()
        if self._on_connect is not None:
            self._on_connect(self, transport)

    def _box_data(self, data: bytes) -> None:
        if self._chan is not None:
            with contextlib.suppress(OSError):  # the channel is closing: nobody to tell
                self._chan.write(data)

    def _box_eof_received(self) -> bool:
        self._box_eof = True
        if self._chan is not None:
            self._chan.write_eof()
        return not self._client_eof  # False when both ways are done: asyncio closes it

    def _box_full(self, full: bool) -> None:
        if self._chan is not None:
            if full:
                self._chan.pause_reading()  # no window adjust: the client stops sending
            else:
                self._chan.resume_reading()

    def _box_lost(self) -> None:
        self._sock = None
        self._box_closed = True
        if self._chan is not None:
            self._chan.close()  # after what is buffered for the client


class _BoxSide(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self._relay = relay

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._relay._box_connected(transport)

    def data_received(self, data: bytes) -> None:
        self._relay._box_data(data)

    def eof_received(self) -> bool:
        return self._relay._box_eof_received()

    def pause_writing(self) -> None:
        self._relay._box_full(True)

    def resume_writing(self) -> None:
        self._relay._box_full(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._relay._box_lost()


def counter(activity: Activity) -> Count:
    """What a forward calls with the bytes the client sent through it."""
    return functools.partial(activity.traffic, "forward")


def _open_failed(exc: OSError) -> asyncssh.ChannelOpenError:
    """What sshd answers when the destination cannot be reached: the client then says
    "open failed: connect failed: Connection refused" (and `ssh -W` exits 255)."""
    if isinstance(exc, socket.gaierror) or not exc.errno:
        reason = exc.strerror or str(exc)
    else:
        reason = os.strerror(exc.errno)
    return asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, reason)


def _opened(conn: asyncssh.SSHServerConnection, relay: Relay) -> Relay:
    # asyncssh drops, without closing it, a session whose connection closed meanwhile.
    if conn.is_closed():
        if relay._sock is not None:
            relay._sock.abort()
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "SSH connection closed")
    return relay


async def open_tcp(
    conn: asyncssh.SSHServerConnection, host: str, port: int, *, activity: Activity
) -> Relay:
    """A direct-tcpip channel's relay, once its destination accepted the connection."""
    relay = Relay(counter(activity))
    try:
        await asyncio.get_running_loop().create_connection(lambda: relay.protocol, host, port)
    except OSError as exc:
        raise _open_failed(exc) from None
    return _opened(conn, relay)


async def open_unix(
    conn: asyncssh.SSHServerConnection, path: str, *, home: str, activity: Activity
) -> Relay:
    """A direct-streamlocal channel's relay (`ssh -L PORT:/path/to.sock`); a relative path
    is the session's home's."""
    relay = Relay(counter(activity))
    try:
        await asyncio.get_running_loop().create_unix_connection(
            lambda: relay.protocol, os.path.join(home, path)
        )
    except OSError as exc:
        raise _open_failed(exc) from None
    return _opened(conn, relay)
