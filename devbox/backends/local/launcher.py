"""Starts a local box, its keeper and through it a detached `devbox agent`, and waits for
the agent's ready frame; on any failure or interrupt it ends all it started first."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from devbox import gpulocks, private, protocol
from devbox import hang as hang_rule
from devbox.backends.local import keeper, store
from devbox.errors import DevboxError, ResourceError, UsageError

# The keeper ends the agent and every process of the box (keeper.py), within its graces.
END_TIMEOUT = keeper.AGENT_GRACE + keeper.TERM_GRACE + 5.0


@dataclass(frozen=True)
class Ready:
    port: int
    host_key: str
    fingerprint: str
    gpu_ids: tuple[str, ...]
    pid: int
    multiplexer: str
    keeper: int


def _read_frame(fd: int, timeout: float) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise DevboxError(f"the box's agent did not start within {timeout:g}s")
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    return buf


def start_agent(
    *,
    name: str,
    folder: Path,
    gpus: int,
    port: int,
    multiplexer: str,
    timeout: float,
    hang: hang_rule.Rule,
) -> Ready:
    home, log_file = folder / store.HOME, folder / store.AGENT_LOG
    private.ensure_dir(home)  # other users of the machine must not read the box's files
    read_fd, write_fd = os.pipe()
    argv = [
        sys.executable,
        "-m",
        "devbox",
        "agent",
        "--name",
        name,
        "--home",
        str(home),
        "--authorized-key",
        str(folder / store.AUTHORIZED_KEY),
        "--host-key",
        str(folder / store.HOST_KEY),
        "--port",
        str(port),
        "--gpus",
        str(gpus),
        "--gpu-namespace",
        gpulocks.namespace(),
        "--lock-file",
        str(folder / store.AGENT_LOCK),
        "--activity-file",
        str(folder / store.ACTIVITY_FILE),
        "--alerts-file",
        str(folder / store.ALERTS_FILE),
        "--release-file",
        str(folder / store.RELEASE_FILE),
        "--saved-file",
        str(folder / store.SAVED_FILE),
        *hang.agent_args(),
        "--multiplexer",
        multiplexer,
        "--ready-fd",
        str(write_fd),
    ]
    # A release of an earlier box of this name asked and answered; this one has not yet.
    for stale in (store.RELEASE_FILE, store.SAVED_FILE):
        with contextlib.suppress(FileNotFoundError):
            (folder / stale).unlink()
    proc: subprocess.Popen[bytes] | None = None
    try:
        with _interrupts_held(), os.fdopen(private.open_append(log_file), "ab") as log:
            proc = subprocess.Popen(
                # The keeper lives as long as the box: the standard library only (-I -S),
                # from its bytecode (keeper.RUN).
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    keeper.RUN,
                    str(folder / store.KEEPER_LOCK),
                    str(write_fd),
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(write_fd,),
                cwd=home,
                start_new_session=True,  # detached: survives the terminal closing
            )
        os.close(write_fd)
        write_fd = -1
        raw = _read_frame(read_fd, timeout)
        if not raw:
            code = proc.wait()
            raise DevboxError(
                f"the box's agent exited ({code}) before it was ready; see {log_file}"
            )
        return _ready(raw, proc)
    except BaseException:
        # ctrl-c, a timeout or an error: nothing of the box may outlive the claim.
        if proc is not None:
            end_keeper(proc.pid, wait=proc.wait)
        raise
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Holds SIGINT back while the keeper is forked: an interrupt then arrives after Popen
    has returned, when there is a process to end, never between its fork and its return.
    (A SIGTERM kills `devbox up` outright, anywhere: it leaves the pending record, which
    `ls` shows and `down` removes with all the box's processes.)"""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def end_keeper(pid: int, *, wait: Callable[[], object]) -> None:
    """SIGTERM the box's keeper, which ends every process of the box, and wait for it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    wait()


def _ready(raw: bytes, proc: subprocess.Popen[bytes]) -> Ready:
    frame = protocol.decode(raw.strip())
    if frame.type == protocol.ERROR:
        proc.wait()  # the agent exits; with nothing else started, so does its keeper
        message = str(frame.body.get("message", "unknown error"))
        kind = frame.body.get("kind")
        if kind == "usage":
            raise UsageError(message)
        if kind == "resource":
            raise ResourceError(message)
        raise DevboxError(message)
    body = frame.body
    return Ready(
        port=int(body["port"]),
        host_key=str(body["host_key"]),
        fingerprint=str(body["host_key_fingerprint"]),
        gpu_ids=tuple(str(g) for g in body.get("gpu_ids", [])),
        pid=int(body["pid"]),
        multiplexer=str(body.get("multiplexer", "")),
        keeper=proc.pid,
    )
