"""The process in a run's window: `python -m devbox.runs.wrapper RUNS/<id>`.

It runs the command on a terminal of its own (so progress bars and line buffering behave
as in a shell), copies everything the command writes to the run's log and to the window,
passes the window's keystrokes and size on, and writes the start and the end (exit status
or signal) into the record. It lives in the box's screen/tmux session, not in any SSH
connection, so the run goes on when the laptop goes away. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import termios
import time
import tty
from pathlib import Path
from typing import Any

from devbox.runs import record

CHUNK = 64 * 1024
# After the command exits, how long output still in flight may take (a background job
# that keeps the terminal open must not keep the run "running").
DRAIN_SECONDS = 0.3


def _winsize(fd: int) -> bytes | None:
    try:
        return fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
    except OSError:
        return None


def _make_controlling_tty() -> None:  # in the child, between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Window:
    """The window's terminal (or nothing): output to it is best effort; the log is the record."""

    def __init__(self) -> None:
        self.tty = os.isatty(0) and os.isatty(1)
        self.saved: list[Any] | None = None
        if self.tty:
            self.saved = termios.tcgetattr(0)
            tty.setraw(0, termios.TCSANOW)  # keys go to the command's terminal as typed
            os.set_blocking(1, False)  # a stalled window must not stall the run or its log

    def write(self, data: bytes) -> None:
        if not self.tty:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            _write_all(1, data)

    def restore(self) -> None:
        if self.saved is not None:
            with contextlib.suppress(OSError):
                os.set_blocking(1, True)
                termios.tcsetattr(0, termios.TCSANOW, self.saved)


def _start(run: record.Run, slave: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DEVBOX_RUN_ID=run.id)
    if run.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = run.gpus
    shell = os.environ.get("SHELL") or "/bin/sh"
    return subprocess.Popen(
        [shell, "-c", run.command],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=run.cwd,
        env=env,
        start_new_session=True,  # its own group: `devbox kill` signals all of it
        preexec_fn=_make_controlling_tty,
    )


def _relay(proc: subprocess.Popen[bytes], master: int, log: int, window: _Window) -> int:
    """Copy until the command has exited and its terminal went quiet; returns its status."""
    sel = selectors.DefaultSelector()
    sel.register(master, selectors.EVENT_READ, "out")
    if window.tty:
        sel.register(0, selectors.EVENT_READ, "in")
    exited_at: float | None = None
    while True:
        status = proc.poll()
        if status is not None and exited_at is None:
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > DRAIN_SECONDS:
            return status if status is not None else 1
        for key, _ in sel.select(timeout=0.05 if exited_at is not None else 0.2):
            if key.data == "in":
                try:
                    data = os.read(0, CHUNK)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(0)  # the window went away; the run goes on
                    continue
                with contextlib.suppress(OSError):
                    _write_all(master, data)
                continue
            try:
                chunk = os.read(master, CHUNK)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                chunk = b""  # every holder of the terminal closed it
            if not chunk:
                sel.unregister(master)
                if status is None:
                    return proc.wait()
                return status
            _write_all(log, chunk)
            window.write(chunk)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0])
    root, run_id = folder.parent, folder.name
    lock = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process ends, however it ends
    run = record.read(root, run_id)
    log = os.open(folder / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    window = _Window()
    master, slave = os.openpty()
    size = _winsize(0) if window.tty else None
    if size:
        fcntl.ioctl(master, termios.TIOCSWINSZ, size)
    try:
        proc = _start(run, slave)
    except OSError as exc:
        _write_all(log, f"devbox: cannot start the command: {exc}\r\n".encode())
        window.restore()
        now = time.time()
        record.write(root, dataclasses.replace(run, started_at=now, ended_at=now, exit_code=127))
        _finish(root, run_id)
        return 127
    finally:
        os.close(slave)
    record.write(root, dataclasses.replace(run, started_at=time.time(), pid=proc.pid))

    def forward(signum: int, _frame: object) -> None:
        # The session ending (SIGHUP) or an explicit kill of the wrapper: pass it on and
        # keep relaying until the command is gone, so its end is still recorded.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)

    def resize(_signum: int, _frame: object) -> None:
        new = _winsize(0)
        if new:
            with contextlib.suppress(OSError):
                fcntl.ioctl(master, termios.TIOCSWINSZ, new)  # the kernel tells the command

    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    signal.signal(signal.SIGWINCH, resize)
    try:
        status = _relay(proc, master, log, window)
    finally:
        window.restore()
    current = record.read(root, run_id)
    ended = dataclasses.replace(
        current,
        ended_at=time.time(),
        exit_code=status if status >= 0 else None,
        signal=signal.Signals(-status).name.removeprefix("SIG") if status < 0 else None,
    )
    record.write(root, ended)
    _finish(root, run_id)
    return ended.status_code()


def _finish(root: Path, run_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record.active_dir(root) / run_id)


if __name__ == "__main__":
    sys.exit(main())
