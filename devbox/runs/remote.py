"""The laptop's side of the in-box helper (devbox/runs/boxside.py): one SSH exec per action,
through OpenSSH where `devbox ssh` would use it, else devbox's own client."""

from __future__ import annotations

import json
import shlex
import subprocess

from devbox.backends.base import Backend
from devbox.boxes import Box
from devbox.errors import DevboxError, UsageError
from devbox.runs.record import PYTHON_ENV, Run

# The agent gives every session PYTHON_ENV: the interpreter that has devbox, whatever the
# box's PATH says. python3 is for agents older than `devbox run`.
HELPER = f'"${{{PYTHON_ENV}:-python3}}" -m devbox.runs.boxside'


def helper_command(*words: str) -> str:
    return f"{HELPER} {shlex.join(words)}"


def live(backend: Backend, name: str) -> Box:
    box = backend.get(name)
    if box.state.value not in ("running", "idle"):
        raise UsageError(f"box {box.name} is {box.state.value}: {box.reason or 'not reachable'}")
    return box


def session(backend: Backend, box: Box, *words: str, interactive: bool = False) -> int:
    """The helper with the terminal's stdin, stdout and stderr: its output and its one-line
    errors reach the user as they are."""
    from devbox import connect

    return connect.session(backend, box, helper_command(*words), interactive=interactive)


def capture(backend: Backend, box: Box, *words: str) -> tuple[int, bytes, bytes]:
    from devbox import connect
    from devbox.ssh import openssh

    command = helper_command(*words)
    ssh = openssh.available() if backend.direct_ssh else None
    if ssh is None:
        from devbox.ssh import client

        return client.capture(box, connect.open_socket(backend, box), command)
    done = subprocess.run(
        openssh.argv(ssh, box, command, tty=False),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    if done.returncode == 255:
        connect.probe(backend, box)  # names a connection failure in one line
    return done.returncode, done.stdout, done.stderr


def _error(box: Box, status: int, err: bytes) -> DevboxError:
    lines = err.decode(errors="replace").strip().splitlines()
    last = lines[-1].removeprefix("devbox: error: ") if lines else f"exit status {status}"
    if "No module named" in last:
        last = f"box {box.name} has no devbox with `devbox run` support ({last})"
    return UsageError(last) if status == 2 else DevboxError(last)


def list_runs(backend: Backend, box: Box) -> list[Run]:
    status, out, err = capture(backend, box, "list")
    if status != 0:
        raise _error(box, status, err)
    try:
        return [Run.from_json(item) for item in json.loads(out)]
    except (ValueError, TypeError) as exc:
        raise DevboxError(f"box {box.name} sent an unreadable run list ({exc})") from None


def read_log(backend: Backend, box: Box, run_id: str, *, tail: int) -> bytes:
    status, out, err = capture(backend, box, "log", run_id, "--tail", str(tail))
    if status != 0:
        raise _error(box, status, err)
    return out


def start_detached(backend: Backend, box: Box, spec: str) -> dict[str, str]:
    status, out, err = capture(backend, box, "start", spec)
    if status != 0:
        raise _error(box, status, err)
    reply: dict[str, str] = json.loads(out)
    return reply
