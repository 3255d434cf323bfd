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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devbox.boxes import Box

CHUNK = 256 * 1024
MARKERS_KEPT = 86400.0  # seconds a notified warning is remembered past its release time


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


def watch_release(box: Box, look: Callable[[], Box], *, every: float) -> threading.Thread:
    """While this process bridges: a desktop notification when the box gets a release
    warning, one per warning however many bridges to it are open (VS Code holds several).
    `look` fetches the box anew, every `every` seconds. Nothing here writes to stdout (the
    SSH stream), and no failure here reaches the bridge."""

    def watch() -> None:
        current = box
        while True:
            with contextlib.suppress(Exception):
                if current.release_at:
                    _notify_once(current)
            time.sleep(every)
            with contextlib.suppress(Exception):  # the API server away: look again later
                current = look()

    thread = threading.Thread(target=watch, daemon=True, name="release-warnings")
    thread.start()
    return thread


def _notify_once(box: Box) -> None:
    from devbox import desktop, paths, private
    from devbox.boxes import release_warning

    folder = private.ensure_dir(paths.state_dir() / "notified")
    prefix = f"{box.backend}.{box.name}."
    marker = folder / f"{prefix}{int(box.release_at)}"
    try:  # the first bridge to make it notifies; the others see it there
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        return
    for old in folder.glob(f"{prefix}*"):  # warnings long past: the box is gone or kept
        with contextlib.suppress(OSError, ValueError):
            if int(old.name.rsplit(".", 1)[1]) < time.time() - MARKERS_KEPT:
                old.unlink()
    clock = time.strftime("%H:%M", time.localtime(box.release_at))
    text = release_warning(box.name, box.release_reason, box.release_at)
    desktop.notify(f"devbox: box {box.name} will be released at {clock}", text.split(": ", 1)[1])
