"""Runs what an SSH channel asks for (a shell, a command) on a PTY or on pipes, and relays it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import os
import signal
import struct
import subprocess
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncssh

from agent.tasks import Tasks

# Big reads keep per-chunk Python overhead small on bulk transfers (rsync, tar).
CHUNK = 256 * 1024
# Linux's fcntl to resize a pipe (Python >= 3.10 names it on Linux only).
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPE_BYTES = CHUNK
# After a PTY shell exits, how long to wait for output still in flight; a
# background job that keeps the terminal open must not hold the channel forever.
PTY_DRAIN_SECONDS = 0.5

Process = asyncssh.SSHServerProcess[bytes]


@dataclass(frozen=True, kw_only=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    on_input: Callable[[int], None]  # bytes the client sent, as they arrive


def _set_winsize(fd: int, width: int, height: int, pixwidth: int = 0, pixheight: int = 0) -> None:
    if width > 0 and height > 0:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, pixwidth, pixheight))


def _make_controlling_tty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


async def _fd_ready(fd: int, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    add, remove = (
        (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    )

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    add(fd, wake)
    try:
        await fut
    finally:
        remove(fd)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _exit(process: Process, returncode: int) -> None:
    if returncode < 0:
        name = signal.Signals(-returncode).name.removeprefix("SIG")
        process.exit_with_signal(name)
    else:
        process.exit(returncode)


async def _channel_input(
    process: Process,
    launch: Launch,
    write: Callable[[bytes], Awaitable[None]],
    *,
    on_resize: Callable[[int, int, int, int], None],
    pid: int,
) -> None:
    """Client -> program until the client sends EOF; resizes and signals are applied on the way."""
    while True:
        try:
            data = await process.stdin.read(CHUNK)
        except asyncssh.TerminalSizeChanged as change:
            on_resize(change.width, change.height, change.pixwidth, change.pixheight)
            continue
        except asyncssh.SignalReceived as sig:
            with contextlib.suppress(KeyError):
                _signal_group(pid, signal.Signals["SIG" + sig.signal].value)
            continue
        except asyncssh.BreakReceived:
            continue
        if not data:
            return
        launch.on_input(len(data))
        await write(data)


def _spawn(launch: Launch, stdio: tuple[int, int, int], *, tty: bool) -> subprocess.Popen[bytes]:
    # subprocess, not asyncio's: asyncio kills a child whose transport is collected before it
    # ends, and a program whose client went away must run on, even past this agent.
    return subprocess.Popen(
        launch.argv,
        stdin=stdio[0],
        stdout=stdio[1],
        stderr=stdio[2],
        env=launch.env,
        cwd=launch.cwd,
        start_new_session=True,
        preexec_fn=_make_controlling_tty if tty else None,
    )


async def _exited(proc: subprocess.Popen[bytes]) -> int:
    """The program's exit status, once it has ended (a pidfd wakes the loop for it)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: look now and then
        while (status := proc.poll()) is None:
            await asyncio.sleep(0.05)
        return status
    try:
        while (status := proc.poll()) is None:
            await _fd_ready(pidfd, write=False)
        return status
    finally:
        os.close(pidfd)


async def _wait_program(process: Process, proc: subprocess.Popen[bytes]) -> int | None:
    """The program's exit status; None when the client went away first.

    No signal is sent then, as under OpenSSH's sshd: the caller closes the program's pipes
    (it sees EOF, and EPIPE when it writes) or its terminal (the kernel's hangup SIGHUPs
    the terminal's session), and a `cmd &` job, a nohup or a screen window goes on."""
    exited = asyncio.ensure_future(_exited(proc))
    if await _before_close(process, exited):
        return exited.result()
    exited.cancel()
    return None


async def _before_close(process: Process, work: asyncio.Future[Any]) -> bool:
    """Wait for `work`; False when the channel closed first (`work` is left running)."""
    closed = asyncio.ensure_future(process.channel.wait_closed())
    try:
        await asyncio.wait({work, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
    return work.done()


def _let_run_on(proc: subprocess.Popen[bytes], tasks: Tasks) -> None:
    """A program whose client went away while it ran is reaped when it ends (a zombie per
    disconnect otherwise). If the agent ends first, it is reparented and goes on."""
    if proc.poll() is not None:
        return
    tasks.spawn(f"reap {proc.pid}", _exited(proc))


class _Fds:
    """The agent's ends of a program's pipes, each closed once (a number closed twice
    could be another channel's by then)."""

    def __init__(self, *fds: int) -> None:
        self.open = set(fds)

    def close(self, fd: int) -> None:
        if fd in self.open:
            self.open.discard(fd)
            os.close(fd)

    def close_all(self) -> None:
        for fd in list(self.open):
            self.close(fd)


def _widen(fd: int) -> None:
    """A pipe as large as one read: a bulk copy then takes a quarter of the reads, writes
    and loop turns that Linux's 64 KiB pipes cost (measured side by side: 8-12% less agent
    CPU a MiB either way). Two such pipes a command are 128 pages of the user's
    16,384 (fs.pipe-user-pages-soft): 128 commands at once before that quota bites."""
    with contextlib.suppress(OSError):  # past the user's pipe quota: the default size stays
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)


async def _read(fd: int) -> bytes:
    """The next chunk from a non-blocking fd; b"" at its end."""
    while True:
        try:
            return os.read(fd, CHUNK)
        except BlockingIOError:
            await _fd_ready(fd, write=False)


async def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await _fd_ready(fd, write=True)


async def run_on_pipes(process: Process, launch: Launch, *, tasks: Tasks) -> None:
    # Pipes of the agent's own rather than asyncio's: when the client goes away they are
    # closed while the program runs on, as sshd does.
    child_in, to_child = os.pipe()
    from_out, child_out = os.pipe()
    from_err, child_err = os.pipe()
    fds = _Fds(to_child, from_out, from_err)
    try:
        proc = _spawn(launch, (child_in, child_out, child_err), tty=False)
    except BaseException:
        fds.close_all()
        raise
    finally:
        for fd in (child_in, child_out, child_err):
            os.close(fd)
    for fd in (to_child, from_out, from_err):
        os.set_blocking(fd, False)
    for fd in (to_child, from_out):
        _widen(fd)

    async def feed() -> None:
        try:
            await _channel_input(
                process, launch, lambda data: _write(to_child, data),
                on_resize=lambda *_: None, pid=proc.pid,
            )  # fmt: skip
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program closed its stdin
        finally:
            fds.close(to_child)  # EOF from the client is EOF for the program

    async def relay(fd: int, writer: asyncssh.SSHWriter[bytes]) -> None:
        while chunk := await _read(fd):
            writer.write(chunk)
            await writer.drain()

    feeder = asyncio.create_task(feed(), name=f"stdin->{proc.pid}")
    relays = asyncio.gather(relay(from_out, process.stdout), relay(from_err, process.stderr))
    returncode: int | None = None
    hung_up = False
    try:
        returncode = await _wait_program(process, proc)
        # The output still in the pipes, unless the client goes meanwhile (a `cmd &` job
        # that holds stdout open keeps it, as under sshd, until it closes it).
        hung_up = returncode is None or not await _before_close(process, relays)
    finally:
        feeder.cancel()
        relays.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError, asyncssh.Error):
            await relays
        fds.close_all()
        if proc.poll() is None and not hung_up:  # cancelled: the agent is shutting down
            _signal_group(proc.pid, signal.SIGHUP)
        _let_run_on(proc, tasks)
    if returncode is not None and not hung_up:
        _exit(process, returncode)


async def run_on_pty(process: Process, launch: Launch, *, tasks: Tasks) -> None:
    master, slave = os.openpty()
    width, height, pixwidth, pixheight = process.get_terminal_size()
    _set_winsize(master, width, height, pixwidth, pixheight)
    try:
        # The terminal's name, as sshd sets it (tty(1), `write`, prompts that show it).
        launch = dataclasses.replace(launch, env={**launch.env, "SSH_TTY": os.ttyname(slave)})
        proc = _spawn(launch, (slave, slave, slave), tty=True)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)

    async def relay_output() -> None:
        while True:
            try:
                chunk = os.read(master, CHUNK)
            except BlockingIOError:
                await _fd_ready(master, write=False)
                continue
            except OSError as exc:
                if exc.errno == errno.EIO:  # every holder of the terminal closed it
                    return
                raise
            if not chunk:
                return
            process.stdout.write(chunk)
            await process.stdout.drain()

    feeder = asyncio.create_task(
        _channel_input(
            process,
            launch,
            lambda data: _write(master, data),
            on_resize=lambda w, h, pw, ph: _set_winsize(master, w, h, pw, ph),
            pid=proc.pid,
        ),
        name=f"pty-in->{proc.pid}",
    )
    output = asyncio.create_task(relay_output(), name=f"pty-out<-{proc.pid}")
    returncode: int | None = None
    hung_up = False
    try:
        returncode = await _wait_program(process, proc)
        hung_up = returncode is None
        if returncode is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(output), PTY_DRAIN_SECONDS)
    finally:
        if proc.poll() is None and not hung_up:  # cancelled: the agent is shutting down
            _signal_group(proc.pid, signal.SIGHUP)
        feeder.cancel()
        output.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await output
        # When the client went away, this is the hangup, as sshd's: the kernel SIGHUPs the
        # terminal's session leader and foreground job (a screen client detaches, a shell
        # hangs up its jobs), and what ignores it, such as a nohup job, goes on.
        os.close(master)
        _let_run_on(proc, tasks)
    if returncode is not None:
        _exit(process, returncode)
