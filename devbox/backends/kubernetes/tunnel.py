"""The port-forward's data path: the API server's WebSocket (v4.channel.k8s.io) on one
side, a local byte stream (a socket, or stdin and stdout) on the other, pumped by one
thread with non-blocking I/O.

One thread, not one per direction: the WebSocket is usually a TLS socket, and an OpenSSL
connection must not be read and written from two threads at once. Not asyncio either:
importing it costs 30-40 ms of every claim and of every `ssh NAME.devbox`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import ssl
import struct

CHUNK = 256 * 1024
HIGH = 4 * CHUNK  # bytes queued for one side before the other is no longer read
CLOSE_WAIT = 5.0  # seconds the last bytes (and the close frame) may take to leave


def mask(payload: bytes, key: bytes) -> bytes:
    # One XOR of two big integers: C speed, where a per-byte Python loop is not.
    n = len(payload)
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """A client's frame (RFC 6455: masked), final, of `opcode` (0x2: binary)."""
    key = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + key + mask(payload, key)


class Ended(Exception):
    """The tunnel is over: the server closed it or said why on the error channel."""


class Pump:
    """Moves bytes between `wire` (the upgraded connection, `pending` its bytes already
    read) and the local side (`local_in` read, `local_out` written: one socket's fd
    twice, or stdin and stdout), until either side ends."""

    def __init__(self, wire: socket.socket, pending: bytes, local_in: int, local_out: int) -> None:
        self.wire = wire
        self.local_in, self.local_out = local_in, local_out
        self.inbuf = bytearray(pending)  # the server's frames, not yet decoded
        self.to_local = bytearray()  # data channel bytes for the local side
        self.to_wire = bytearray()  # our frames, not yet handed to the socket
        self.sending = b""  # handed to TLS and refused for now: retried as it is
        self.seen: set[int] = set()  # channels whose opening port number was skipped
        self.local_open = True  # the local side may still send
        self.wire_wants_read = False  # TLS needs to read before it can write

    def run(self) -> None:
        self.wire.setblocking(False)
        os.set_blocking(self.local_in, False)
        os.set_blocking(self.local_out, False)
        sel = selectors.DefaultSelector()
        try:
            self._decode()
            while self.local_open or self.sending or self.to_wire:
                self._flush_local()
                self._flush_wire()
                if not self.local_open and not (self.sending or self.to_wire):
                    break
                wire_ev = local_in_ev = local_out_ev = 0
                if len(self.to_local) < HIGH or self.wire_wants_read:
                    wire_ev |= selectors.EVENT_READ
                if (self.sending or self.to_wire) and not self.wire_wants_read:
                    wire_ev |= selectors.EVENT_WRITE
                if self.local_open and len(self.to_wire) < HIGH:
                    local_in_ev = selectors.EVENT_READ
                if self.to_local:
                    local_out_ev = selectors.EVENT_WRITE
                # Decrypted bytes TLS holds already do not make the socket readable.
                pending = isinstance(self.wire, ssl.SSLSocket) and self.wire.pending() > 0
                events = _select(
                    sel,
                    [
                        (self.wire.fileno(), wire_ev),
                        (self.local_in, local_in_ev),
                        (self.local_out, local_out_ev),
                    ],
                    timeout=0 if pending and wire_ev & selectors.EVENT_READ else None,
                )
                if events.get(self.wire.fileno(), 0) & selectors.EVENT_READ or (
                    pending and wire_ev & selectors.EVENT_READ
                ):
                    self._read_wire()
                if events.get(self.local_in, 0) & selectors.EVENT_READ:
                    self._read_local()
        except Ended:
            self._drain_local()
        finally:
            sel.close()

    # --- the server's side ------------------------------------------------------------

    def _read_wire(self) -> None:
        self.wire_wants_read = False
        for _ in range(16):  # then the other side gets its turn
            try:
                data = self.wire.recv(CHUNK)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                break
            except ssl.SSLWantWriteError:
                break  # renegotiation wants to write: the next flush does it
            if not data:
                raise Ended("the server closed the connection")
            self.inbuf += data
            if len(self.inbuf) >= CHUNK:
                break
        self._decode()

    def _decode(self) -> None:
        """Whole frames out of inbuf: data for the local side, pongs for pings. (After
        Ended the buffer is left as it is: nobody reads it again.)"""
        buf, at, end = self.inbuf, 0, len(self.inbuf)
        while end - at >= 2:
            b1, b2 = buf[at], buf[at + 1]
            n, start = b2 & 0x7F, at + 2
            if n == 126:
                if end - start < 2:
                    break
                n, start = int.from_bytes(buf[start : start + 2], "big"), start + 2
            elif n == 127:
                if end - start < 8:
                    break
                n, start = int.from_bytes(buf[start : start + 8], "big"), start + 8
            key = b""
            if b2 & 0x80:  # a server's frames are not masked; tolerated all the same
                if end - start < 4:
                    break
                key, start = bytes(buf[start : start + 4]), start + 4
            if end - start < n:
                break
            at = start + n
            opcode = b1 & 0x0F
            if opcode == 0x8:  # close
                raise Ended("the server closed the port-forward")
            if opcode == 0x9:  # ping
                ping = bytes(buf[start:at])
                self.to_wire += frame(mask(ping, key) if key else ping, 0xA)
            elif opcode in (0x0, 0x2) and n:
                if key:
                    self._channel(memoryview(mask(bytes(buf[start:at]), key)))
                else:  # a view, not a copy: this is the bulk-transfer path
                    self._channel(memoryview(buf)[start:at])
        del buf[:at]

    def _channel(self, payload: memoryview) -> None:
        channel, skip = payload[0], 1
        if channel not in self.seen:  # each channel opens with the port number
            self.seen.add(channel)
            skip = 3
        if len(payload) <= skip:
            return
        if channel == 0:
            self.to_local += payload[skip:]
        elif channel == 1:
            text = bytes(payload[skip:]).decode(errors="replace")
            raise Ended(f"port-forward: {text}")

    def _flush_wire(self) -> None:
        while self.sending or self.to_wire:
            if not self.sending:
                self.sending = bytes(self.to_wire[:CHUNK])
                del self.to_wire[:CHUNK]
            try:
                sent = self.wire.send(self.sending)
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                return
            except ssl.SSLWantReadError:
                self.wire_wants_read = True
                return
            # TLS takes all of it or nothing (no partial writes); a plain socket may not.
            self.sending = self.sending[sent:]

    # --- the local side ---------------------------------------------------------------

    def _read_local(self) -> None:
        try:
            data = os.read(self.local_in, CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self.to_wire += frame(b"\x00" + data)
        else:
            # The local side is done: so is the port-forward (it has no half-close).
            self.to_wire += frame(b"", 0x8)
            self.local_open = False
            self._finish_wire()

    def _flush_local(self) -> None:
        while self.to_local:
            try:
                written = os.write(self.local_out, self.to_local[:CHUNK])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                    raise Ended("the local side closed") from None
                raise
            del self.to_local[:written]

    def _drain_local(self) -> None:
        """What the server sent before it ended still reaches the local side."""
        with contextlib.suppress(OSError):
            os.set_blocking(self.local_out, True)
            while self.to_local:
                written = os.write(self.local_out, self.to_local[:CHUNK])
                del self.to_local[:written]

    def _finish_wire(self) -> None:
        """The close frame and whatever precedes it leave, for at most CLOSE_WAIT."""
        with contextlib.suppress(OSError):
            self.wire.settimeout(CLOSE_WAIT)
            if self.sending:
                self.wire.sendall(self.sending)
            self.wire.sendall(bytes(self.to_wire))
        self.sending, self.to_wire = b"", bytearray()


def _select(
    sel: selectors.BaseSelector, wanted: list[tuple[int, int]], *, timeout: float | None
) -> dict[int, int]:
    """One wait for the (fd, events) pairs with events; {fd: events that happened}."""
    merged: dict[int, int] = {}
    for fd, events in wanted:
        if events:
            merged[fd] = merged.get(fd, 0) | events
    for fd, events in merged.items():
        try:
            sel.modify(fd, events)
        except KeyError:
            sel.register(fd, events)
    for key in list(sel.get_map().values()):
        if key.fd not in merged:
            sel.unregister(key.fd)
    if not merged:
        return {}
    return {key.fd: ready for key, ready in sel.select(timeout)}
