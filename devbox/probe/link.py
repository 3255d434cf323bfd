"""The training process's line to the box's agent: a daemon thread that owns the Unix
socket, turns queued reports into frames (the device-to-host copy happens here, not on the
training thread), and reconnects, quietly, whenever the agent is missing or dies.

No torch here: a job is any callable that returns the frames to send.

A request for "stacks" is answered here, on the link thread, before the owner's frame
handler sees it: it must come while the training thread is stuck, and it needs no model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devbox import protocol
from devbox.probe import stacks

log = logging.getLogger("devbox.probe")

# Reports waiting for the thread; a full queue drops the newest (training never waits).
QUEUE = 8
BACKOFF = (0.5, 1.0, 2.0, 5.0)
# A send that takes longer means a stuck agent: the link is dropped and made again.
SEND_TIMEOUT = 5.0

Job = Callable[[], list[bytes]]


def socket_path() -> str | None:
    """Where the agent listens. First the pointer file $DEVBOX_PROBE_POINTER names (set in
    every session the agent starts): the agent running the box now rewrites it when it
    starts, so a training process finds an agent restarted since its session began, whose
    $DEVBOX_PROBE_SOCKET is gone (or, after a kill -9, still there but refusing). Then
    $DEVBOX_PROBE_SOCKET, then the pointer under $HOME (in a pod, the box's home) for a
    process started some other way."""
    pointers = [os.environ.get(protocol.PROBE_POINTER_ENV, ""), ""]
    with contextlib.suppress(RuntimeError):  # no home to be found
        pointers[1] = str(Path.home() / protocol.PROBE_POINTER_FILE)
    candidates = [_read_pointer(pointers[0]), os.environ.get(protocol.PROBE_SOCKET_ENV, "")]
    candidates.append(_read_pointer(pointers[1]))
    for path in candidates:
        if path and os.path.exists(path):
            return path
    return None


def _read_pointer(pointer: str) -> str:
    if not pointer:
        return ""
    try:
        return Path(pointer).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


class Link:
    def __init__(
        self,
        *,
        hello: dict[str, Any],
        on_frame: Callable[[protocol.Frame], None],
        find: Callable[[], str | None] = socket_path,
    ) -> None:
        self._hello = hello
        self._on_frame = on_frame
        self._find = find
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=QUEUE)
        self._stop = threading.Event()
        # The thread sleeps in select on the agent's socket and this pair, which `submit`
        # and `close` poke: no polling, so an idle link costs no CPU at all.
        self._wake_out, self._wake_in = socket.socketpair()
        self._wake_out.setblocking(False)
        self._wake_in.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="devbox-probe", daemon=True)
        # Read by the training thread without a lock: a stale value costs one report.
        self.connected = False
        self.dropped = 0  # reports dropped because the thread was behind

    def start(self) -> None:
        self._thread.start()

    def cpu_time(self) -> float:
        """CPU seconds the link thread has used (what a benchmark adds to the steps)."""
        ident = self._thread.ident
        return 0.0 if ident is None else time.clock_gettime(time.pthread_getcpuclockid(ident))

    def close(self) -> None:
        self._stop.set()
        self._wake()

    def submit(self, job: Job) -> None:
        if not self.connected:  # a report made as the link dropped: nobody to send it to
            self.dropped += 1
            return
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            return
        self._wake()

    def _wake(self) -> None:
        # Full (a wake-up is pending anyway) or closed (the thread is gone): nothing to do.
        with contextlib.suppress(OSError):
            self._wake_out.send(b"\0")

    # --- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._connect_and_serve()
        finally:
            self._wake_in.close()
            self._wake_out.close()

    def _connect_and_serve(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            path = self._find()
            sock = self._connect(path) if path else None
            if sock is None:
                self._stop.wait(BACKOFF[min(attempt, len(BACKOFF) - 1)])
                attempt += 1
                continue
            attempt = 0
            try:
                self._serve(sock)
            except OSError as exc:
                log.debug("probe link to %s lost: %s", path, exc)
            finally:
                self.connected = False
                # Nobody watches through a link that is gone; a new agent says otherwise.
                with contextlib.suppress(Exception):
                    self._on_frame(protocol.Frame(protocol.PROBE_CONTROL, {"watching": False}))
                with contextlib.suppress(OSError):
                    sock.close()
                self._drain()

    def _connect(self, path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT)
            sock.connect(path)
            sock.sendall(protocol.encode(protocol.PROBE_HELLO, **self._hello))
        except OSError:
            sock.close()
            return None
        return sock

    def _serve(self, sock: socket.socket) -> None:
        self.connected = True
        buffer = b""
        while not self._stop.is_set():
            readable, _, _ = select.select([sock, self._wake_in], [], [])
            if self._wake_in in readable:
                with contextlib.suppress(BlockingIOError):
                    self._wake_in.recv(4096)  # before the jobs: a later one pokes again
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                try:
                    frames = job()
                except Exception:  # a bad report must not end the link
                    log.exception("devbox.probe: a report failed")
                    frames = []
                for frame in frames:
                    sock.sendall(frame)
            if sock in readable:
                buffer = self._receive(sock, buffer)

    def _receive(self, sock: socket.socket, buffer: bytes) -> bytes:
        # select, not MSG_DONTWAIT: a socket with a timeout waits for data whatever the flags.
        while select.select([sock], [], [], 0)[0]:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the agent closed the probe socket")
            buffer += chunk
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                try:
                    frame = protocol.decode(line)
                except protocol.ProtocolError:
                    raise ConnectionResetError("the agent sent a malformed frame") from None
                if _wants_stacks(frame):
                    sock.sendall(_stacks_reply(frame.body["id"]))
                    continue
                try:
                    self._on_frame(frame)
                except Exception:
                    log.exception("devbox.probe: a frame from the agent failed")
            if len(buffer) > protocol.MAX_FRAME_BYTES:
                raise ConnectionResetError("the agent sent an oversized frame")
        return buffer

    def _drain(self) -> None:
        """Reports queued for a link that is gone are dropped, not sent late."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._jobs.get_nowait()


def _wants_stacks(frame: protocol.Frame) -> bool:
    # A malformed one (no integer id) goes on to the owner, which says what is wrong.
    request_id = frame.body.get("id")
    return (
        frame.type == protocol.PROBE_REQUEST
        and frame.body.get("kind") == "stacks"
        and isinstance(request_id, int)
        and not isinstance(request_id, bool)
    )


def _stacks_reply(request_id: int) -> bytes:
    text = stacks.dump(answering=threading.get_ident())
    body = {"id": request_id, "pid": os.getpid(), "step": 0, "stacks": text}
    return protocol.encode(protocol.PROBE_REPLY, **body)
