"""HTTP/1.1 on one socket: as much of it as the API server's answers need, and a way to
take the socket back once the server switched protocols.

Why not http.client: its response reads through a buffered file that may already hold
the first bytes after a `101 Switching Protocols` (the port-forward's opening frames),
with no public way to get them back, so a port-forward had to open a TLS connection of
its own; and it loads the email package to parse headers. Here the buffer is ours: the
REST requests of a claim and its port-forward share one TLS connection.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field

CHUNK = 64 * 1024
MAX_HEAD = 64 * 1024  # a response head longer than this is not the API server's


class ProtocolError(ConnectionError):
    """The peer's bytes are not an HTTP/1.1 response (or it closed mid-way)."""


@dataclass
class Head:
    status: int
    reason: str
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased
    version: str = "HTTP/1.1"


def connect(
    host: str,
    port: int,
    *,
    context: ssl.SSLContext | None,
    server_name: str,
    timeout: float,
) -> Connection:
    """A connection to host:port; with `context`, TLS checked against `server_name`."""
    raw = socket.create_connection((host, port), timeout=timeout)
    try:
        # Requests and answers are small writes; Nagle would hold one back for an ACK.
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = raw if context is None else context.wrap_socket(raw, server_hostname=server_name)
    except BaseException:
        raw.close()
        raise
    return Connection(sock)


class Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        # False once an answer said the connection ends with it (or ended it).
        self.reusable = True

    def send(self, method: str, target: str, headers: dict[str, str], body: bytes | None) -> None:
        lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))

    def head(self) -> Head:
        """The next response's status line and headers (1xx interim answers skipped, but
        101, which ends HTTP on this connection)."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise ProtocolError("response head too long")
                self._fill()
                end = self._buf.find(b"\r\n\r\n")
            text = bytes(self._buf[:end]).decode("latin-1")
            del self._buf[: end + 4]
            status_line, *lines = text.split("\r\n")
            version, _, rest = status_line.partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise ProtocolError(f"not an HTTP/1.1 response: {status_line[:80]!r}")
            head = Head(int(code), reason, {}, version)
            for line in lines:
                name, sep, value = line.partition(":")
                if not sep:
                    raise ProtocolError(f"malformed header line {line[:80]!r}")
                key = name.strip().lower()
                value = value.strip()
                had = head.headers.get(key)
                head.headers[key] = f"{had}, {value}" if had is not None else value
            if 100 <= head.status < 200 and head.status != 101:
                continue
            connection = head.headers.get("connection", "").lower()
            if "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection):
                self.reusable = False
            return head

    def body(self, head: Head, *, method: str = "GET") -> bytes:
        """The whole body of the response `head` began."""
        return b"".join(self.pieces(head, method=method))

    def pieces(self, head: Head, *, method: str = "GET") -> Iterator[bytes]:
        """The body as it arrives (a watch's events come one chunk at a time)."""
        if method == "HEAD" or head.status in (204, 304) or 100 <= head.status < 200:
            return
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            yield from self._chunked()
            return
        length = head.headers.get("content-length")
        if length is None:
            self.reusable = False  # the body ends when the server closes
            while True:
                if self._buf:
                    yield self._take(len(self._buf))
                if not self._fill(eof_ok=True):
                    return
        if not length.strip().isdigit():
            raise ProtocolError(f"bad Content-Length {length[:40]!r}")
        left = int(length)
        while left:
            if not self._buf:
                self._fill()
            piece = self._take(min(left, len(self._buf)))
            left -= len(piece)
            yield piece

    def lines(self, head: Head) -> Iterator[bytes]:
        """The body line by line (b"\\n" kept off), the last line also without one."""
        pending = b""
        for piece in self.pieces(head):
            pending += piece
            *whole, pending = pending.split(b"\n")
            yield from whole
        if pending:
            yield pending

    def detach(self) -> tuple[socket.socket, bytes]:
        """The socket and what was read from it beyond the last response's head: after a
        101 the bytes of the new protocol, whoever speaks it now."""
        self.reusable = False
        rest, self._buf = bytes(self._buf), bytearray()
        return self.sock, rest

    def close(self) -> None:
        self.reusable = False
        self.sock.close()

    # --- plumbing ---------------------------------------------------------------------

    def _chunked(self) -> Iterator[bytes]:
        while True:
            size_line = self._line()
            size_text = size_line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while self._line():  # trailers, then the blank line
                    pass
                return
            while len(self._buf) < size + 2:
                self._fill()
            if self._buf[size : size + 2] != b"\r\n":
                raise ProtocolError("chunk not followed by CRLF")
            piece = self._take(size)
            del self._buf[:2]
            yield piece

    def _line(self) -> bytes:
        end = self._buf.find(b"\r\n")
        while end < 0:
            if len(self._buf) > MAX_HEAD:
                raise ProtocolError("line too long")
            self._fill()
            end = self._buf.find(b"\r\n")
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _take(self, n: int) -> bytes:
        piece = bytes(self._buf[:n])
        del self._buf[:n]
        return piece

    def _fill(self, *, eof_ok: bool = False) -> bool:
        data = self.sock.recv(CHUNK)
        if not data:
            self.reusable = False
            if eof_ok:
                return False
            raise ProtocolError("the server closed the connection")
        self._buf += data
        return True
