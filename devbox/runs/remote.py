"""The laptop's side of the in-box helper (devbox/runs/boxside.py): one SSH exec per action,
through OpenSSH where `devbox ssh` would use it, else devbox's own client."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys

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


class GatedStart:
    """The helper of a followed `devbox run`, started while the laptop's sync still runs:
    its SSH handshake and its Python's start-up overlap the sync instead of following it
    (bench_run.py). It waits in the box for the spec (boxside's `start -`); `go` sends it
    and relays the run's output, `cancel` ends it with nothing started."""

    def __init__(self, backend: Backend, box: Box, proc: subprocess.Popen[bytes]) -> None:
        self.backend, self.box, self.proc = backend, box, proc

    @classmethod
    def open(cls, backend: Backend, box: Box) -> GatedStart | None:
        """None where it cannot be had (no OpenSSH): the caller starts the run as before."""
        from devbox import connect
        from devbox.runs.boxside import GATED

        proc = connect.spawn(backend, box, helper_command("start", GATED, "--follow"))
        return None if proc is None else cls(backend, box, proc)

    def ready(self) -> bool:
        """Whether the helper waits for its spec; False when it ended first: a devbox in
        the box older than the gate (it refuses "-" as a malformed spec), or no connection.
        Either way nothing was started, and the caller starts the run the old way."""
        from devbox.runs.boxside import READY

        assert self.proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):  # unbuffered: what follows is _relay's to read
            chunk = os.read(self.proc.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
        if line.strip() == READY.encode():
            return True
        self.cancel()
        return False

    def go(self, spec: str) -> int:
        """Send the spec; relay the run's output here until the helper ends; its status."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(spec.encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it ended meanwhile: its stderr and status say why
        try:
            _relay(self.proc)
            status = self.proc.wait()
        except BaseException:  # ctrl-c (ssh had it too): detach, leaving no ssh behind
            self.proc.kill()
            self.proc.wait()
            raise
        if status == 255:
            from devbox import connect

            connect.probe(self.backend, self.box)  # names a connection failure in one line
        return status

    def cancel(self) -> None:
        """End it with nothing started (a closed stdin is boxside's "not after all")."""
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def _relay(proc: subprocess.Popen[bytes]) -> None:
    """The helper's stdout and stderr onto ours, as they come, until both end."""
    import selectors

    assert proc.stdout is not None and proc.stderr is not None
    targets = {proc.stdout.fileno(): sys.stdout.fileno(), proc.stderr.fileno(): sys.stderr.fileno()}
    sys.stdout.flush()
    sys.stderr.flush()
    with selectors.DefaultSelector() as sel:
        for fd in targets:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            for key, _ in sel.select():
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    continue
                view = memoryview(data)
                while view:
                    view = view[os.write(targets[key.fd], view) :]
