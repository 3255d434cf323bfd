"""Starts a detached `devbox agent` for a local box and waits for its ready frame."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from devbox import gpulocks, private, protocol
from devbox.errors import DevboxError, ResourceError, UsageError


@dataclass(frozen=True)
class Ready:
    port: int
    host_key: str
    fingerprint: str
    gpu_ids: tuple[str, ...]
    pid: int
    multiplexer: str


def _read_frame(fd: int, timeout: float, proc: subprocess.Popen[bytes]) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise DevboxError(f"the box's agent did not start within {timeout:g}s")
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    return buf


def start_agent(
    *, name: str, folder: Path, gpus: int, port: int, multiplexer: str, timeout: float
) -> Ready:
    home = folder / "home"
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
        str(folder / "authorized_key"),
        "--host-key",
        str(folder / "host_key"),
        "--port",
        str(port),
        "--gpus",
        str(gpus),
        "--gpu-namespace",
        gpulocks.namespace(),
        "--lock-file",
        str(folder / "agent.lock"),
        "--activity-file",
        str(folder / "activity.json"),
        "--alerts-file",
        str(folder / "alerts.json"),
        "--multiplexer",
        multiplexer,
        "--ready-fd",
        str(write_fd),
    ]
    with os.fdopen(private.open_append(folder / "agent.log"), "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(write_fd,),
            cwd=home,
            start_new_session=True,  # detached: survives the terminal closing
        )
    os.close(write_fd)
    try:
        raw = _read_frame(read_fd, timeout, proc)
    finally:
        os.close(read_fd)
    if not raw:
        code = proc.wait()
        raise DevboxError(
            f"the box's agent exited ({code}) before it was ready; see {folder / 'agent.log'}"
        )
    frame = protocol.decode(raw.strip())
    if frame.type == protocol.ERROR:
        proc.wait()
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
    )
