"""`devbox proxy NAME`: stdin/stdout <-> the box's SSH endpoint, for OpenSSH's ProxyCommand;
and `loopback`, the same for `devbox ssh`'s own OpenSSH child.

Runs on every `ssh NAME.devbox`, so it imports nothing heavy. Each direction is a
thread doing blocking syscalls; ssh -> box uses splice(2) when ssh gave us a pipe,
so those bytes move inside the kernel.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Callable

CHUNK = 256 * 1024


def _copy(
    src: int, dst: int, *, splice: bool, before_read: Callable[[], None] | None = None
) -> None:
    """Copy until EOF on `src`; with `splice`, inside the kernel where it allows it."""
    splice = splice and hasattr(os, "splice")
    while True:
        if before_read is not None:
            before_read()
        if splice:
            try:
                n = os.splice(src, dst, CHUNK)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: neither side is a pipe
                    raise
                splice = False
                continue
            if n == 0:
                return
        else:
            data = os.read(src, CHUNK)
            if not data:
                return
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view) :]


def _stdin_to_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        _copy(0, sock.fileno(), splice=True)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def bridge(sock: socket.socket) -> None:
    """Copy both ways until the box closes the connection; returns then."""
    threading.Thread(target=_stdin_to_socket, args=(sock,), daemon=True).start()
    try:
        # Not splice: from a TCP socket it can report 0 (EOF) while the connection is open.
        _copy(sock.fileno(), 1, splice=False)
    except OSError:
        pass
    finally:
        sock.close()


def loopback(sock: socket.socket, *, timeout: float = 60.0) -> int:
    """A port on 127.0.0.1 whose first connection is joined to `sock`, in threads of this
    process: `devbox ssh` runs OpenSSH against it for a box reached through the API server,
    whose port-forward this process pumps. Another local user who connects first gets a
    tunnel to an SSH server that wants the owner's key, and ssh fails: no more than that."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(timeout)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            sock.close()
            return
        finally:
            listener.close()
        conn.settimeout(None)
        # SSH's handshake and a session's start are runs of small writes. Nagle's algorithm
        # holds a small write back until the one before it is acknowledged, and the other
        # side delays its ACK by up to 40 ms: each such pair stalled 40 ms, and `devbox
        # ssh NAME -- true` took 0.2 s longer than through a ProxyCommand pipe. Our writes
        # go at once (NODELAY); OpenSSH turns NODELAY on only once it is authenticated,
        # so until then ours are acknowledged at once (QUICKACK, which Linux resets: set
        # before every read).
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        quick = getattr(socket, "TCP_QUICKACK", None)
        ack = None if quick is None else lambda: conn.setsockopt(socket.IPPROTO_TCP, quick, 1)
        threading.Thread(target=_join, args=(conn, sock, ack), daemon=True).start()
        _join(sock, conn)

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def _join(
    src: socket.socket, dst: socket.socket, before_read: Callable[[], None] | None = None
) -> None:
    with contextlib.suppress(OSError):
        _copy(src.fileno(), dst.fileno(), splice=False, before_read=before_read)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
