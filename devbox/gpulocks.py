"""Exclusive GPUs on a shared machine: one Linux abstract Unix socket name per GPU.

A GPU is held by whoever has bound the name `\\0<namespace>/<uuid>`. Binding is atomic,
so two claims never both get a GPU. The name lives in the kernel, not in a folder: no
other user can plant it as a file or a symlink, pre-create it with the wrong mode, or
leave it behind, because the kernel drops it the moment its holder dies, however it dies.
Who holds a name is told by the kernel too: a connection to it carries the holder's
uid and pid (SO_PEERCRED), so a refusal can say whose process has the GPU.

The names are scoped to a network namespace: processes on one machine that share it
(all users of a workstation, by default) see the same GPUs taken. The agent (which
takes GPUs) and the local backend (which reports them) both use this module.
"""

from __future__ import annotations

import errno
import os
import pwd
import selectors
import socket
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from devbox.errors import UsageError

NAMESPACE_ENV = "DEVBOX_GPU_NAMESPACE"
DEFAULT_NAMESPACE = "devbox-gpu"
# An abstract name is at most 107 bytes; a GPU UUID is about 40 of them.
MAX_NAMESPACE = 60
QUERY_TIMEOUT = 1  # seconds


class NamespaceError(UsageError):
    pass


def namespace() -> str:
    """The machine's GPU lock namespace; tests run apart with their own ($DEVBOX_GPU_NAMESPACE)."""
    value = os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE
    return check_namespace(value)


def check_namespace(value: str) -> str:
    if not value or len(value) > MAX_NAMESPACE or not value.isprintable() or "\0" in value:
        raise NamespaceError(
            f"GPU lock namespace {value!r} (${NAMESPACE_ENV}) must be "
            f"1-{MAX_NAMESPACE} printable characters"
        )
    return value


def address(ns: str, uuid: str) -> bytes:
    return b"\0" + f"{ns}/{uuid}".encode()


@dataclass(frozen=True)
class Holder:
    """Who has a GPU's name bound, as the kernel tells it; None where it does not listen."""

    uid: int | None = None
    pid: int | None = None

    def describe(self) -> str:
        if self.uid is None:
            return "a process that does not say who it is"
        try:
            who = f"uid {self.uid} ({pwd.getpwuid(self.uid).pw_name})"
        except KeyError:
            who = f"uid {self.uid}"
        return f"{who}, pid {self.pid}"


class Hold:
    """The bound names of one claim; they stay held while this process lives, or, once
    handed over, while the box's keeper does."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets
        self._thread: threading.Thread | None = None
        self._stop: tuple[int, int] | None = None  # wakes the answering thread to end

    def answer(self) -> None:
        """Accept and drop every connection (a holder query): without it they would pile up
        in the backlog, where they stay even after the querier closes, until a full backlog
        hides who holds the GPU."""
        if self._sockets and self._thread is None:
            self._stop = os.pipe()
            self._thread = threading.Thread(
                target=self._serve, args=(self._stop[0],), name="gpu-locks", daemon=True
            )
            self._thread.start()

    def _serve(self, stop: int) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(stop, selectors.EVENT_READ)
            for sock in self._sockets:
                sel.register(sock, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj == stop:
                        return
                    _drop_one(key.fileobj)  # type: ignore[arg-type]

    def hand_over(self, channel: int) -> None:
        """Give the bound names to the box's keeper over `channel` (an inherited Unix socket,
        devbox.backends.local.keeper), then close it: the names stay bound while the keeper
        lives, that is while any process of the box does, not only while this one does.
        Sent before this process reports ready, so no box is ever up without it."""
        with socket.socket(fileno=channel) as sock:
            if self._sockets:
                socket.send_fds(sock, [b"gpus"], [s.fileno() for s in self._sockets])

    def release(self) -> None:
        if self._thread is not None and self._stop is not None:
            os.write(self._stop[1], b"x")
            self._thread.join()  # before closing: it must not select on closed sockets
            for fd in self._stop:
                os.close(fd)
            self._thread = self._stop = None
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()


def _drop_one(sock: socket.socket) -> None:
    try:
        conn, _ = sock.accept()
    except OSError:
        return  # the querier went away first
    conn.close()


def try_hold(ns: str, uuid: str) -> socket.socket | None:
    """The GPU's bound, listening socket, or None when someone else holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec: not inherited
    try:
        sock.bind(address(ns, uuid))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    sock.listen(128)
    sock.setblocking(False)  # accept() in _drop_one must never wait
    return sock


def holder(ns: str, uuid: str) -> Holder | None:
    """Who holds the GPU now; None when nobody does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Where the holder's backlog is full (many queries at once), wait a moment for room;
    # one that never accepts still gets an answer. SO_SNDTIMEO bounds a blocking Unix
    # connect; Python's settimeout would make it non-blocking, failing at once instead.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", QUERY_TIMEOUT, 0))
    try:
        probe.connect(address(ns, uuid))
        uid_pid = _peer(probe)
    except OSError:
        # Refused or never answered: bound by something that is not a devbox agent, or free.
        return Holder() if held_names(ns, [uuid]) else None
    finally:
        probe.close()
    return Holder(uid=uid_pid[0], pid=uid_pid[1])


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid, pid


def held_names(ns: str, uuids: Iterable[str]) -> set[str]:
    """Which of `uuids` are held, from the kernel's list of bound Unix sockets (no connection)."""
    wanted = {f"@{ns}/{u}": u for u in uuids}
    found: set[str] = set()
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
        next(table, None)  # the header
        for line in table:
            fields = line.split()
            # Num RefCount Protocol Flags Type St Inode Path: only bound ones have a path.
            if len(fields) >= 8 and fields[7] in wanted:
                found.add(wanted[fields[7]])
    return found
