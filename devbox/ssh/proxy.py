"""`devbox proxy NAME`: stdin/stdout <-> the box's SSH endpoint, for OpenSSH's ProxyCommand.

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

CHUNK = 256 * 1024


def _copy(src: int, dst: int, *, splice: bool) -> None:
    """Copy until EOF on `src`; with `splice`, inside the kernel where it allows it."""
    splice = splice and hasattr(os, "splice")
    while True:
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
