"""`devbox proxy NAME`: stdin/stdout <-> the box's SSH endpoint, for OpenSSH's ProxyCommand.

Runs on every `ssh NAME.devbox`, so it imports nothing heavy and copies with
plain blocking syscalls in two threads: the simplest fast byte pump in Python.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

CHUNK = 256 * 1024


def _stdin_to_socket(sock: socket.socket) -> None:
    try:
        while data := os.read(0, CHUNK):
            sock.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def bridge(sock: socket.socket) -> None:
    """Copy until the box closes the connection; returns then."""
    threading.Thread(target=_stdin_to_socket, args=(sock,), daemon=True).start()
    try:
        while data := sock.recv(CHUNK):
            view = memoryview(data)
            while view:
                view = view[os.write(1, view) :]
    except OSError:
        pass
    finally:
        sock.close()
