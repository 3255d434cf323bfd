"""Runs what an SSH channel asks for (a shell, a command) on a PTY or on pipes, and relays it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import signal
import struct
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncssh

# Big reads keep per-chunk Python overhead small on bulk transfers (rsync, tar).
CHUNK = 256 * 1024
# After a PTY shell exits, how long to wait for output still in flight; a
# background job that keeps the terminal open must not hold the channel forever.
PTY_DRAIN_SECONDS = 0.5

Process = asyncssh.SSHServerProcess[bytes]


@dataclass(frozen=True, kw_only=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    on_input: Callable[[], None]


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
        launch.on_input()
        await write(data)


async def _wait_program(process: Process, proc: asyncio.subprocess.Process) -> int | None:
    """The program's exit status; None when the client went away first (it was hung up on)."""
    exited = asyncio.ensure_future(proc.wait())
    closed = asyncio.ensure_future(process.channel.wait_closed())
    done, _ = await asyncio.wait({exited, closed}, return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    if exited in done:
        return exited.result()
    # As sshd does: SIGHUP the program's group, so a screen client detaches and a
    # plain command ends, instead of running on without anyone to talk to.
    _signal_group(proc.pid, signal.SIGHUP)
    try:
        await asyncio.wait_for(asyncio.shield(exited), 5)
    except TimeoutError:
        _signal_group(proc.pid, signal.SIGKILL)
        await exited
    return None


async def run_on_pipes(process: Process, launch: Launch) -> None:
    proc = await asyncio.create_subprocess_exec(
        *launch.argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=launch.env,
        cwd=launch.cwd,
        start_new_session=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    stdin = proc.stdin

    async def to_program(data: bytes) -> None:
        stdin.write(data)
        await stdin.drain()

    async def feed() -> None:
        try:
            await _channel_input(
                process, launch, to_program, on_resize=lambda *_: None, pid=proc.pid
            )
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            stdin.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncssh.SSHWriter[bytes]) -> None:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()

    feeder = asyncio.create_task(feed(), name=f"stdin->{proc.pid}")
    relays = asyncio.gather(relay(proc.stdout, process.stdout), relay(proc.stderr, process.stderr))
    try:
        returncode = await _wait_program(process, proc)
        if returncode is not None:
            await relays
    finally:
        if proc.returncode is None:  # cancelled: the agent is shutting down
            _signal_group(proc.pid, signal.SIGHUP)
        feeder.cancel()
        relays.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await relays
    if returncode is not None:
        _exit(process, returncode)


async def run_on_pty(process: Process, launch: Launch) -> None:
    master, slave = os.openpty()
    width, height, pixwidth, pixheight = process.get_terminal_size()
    _set_winsize(master, width, height, pixwidth, pixheight)
    try:
        proc = await asyncio.create_subprocess_exec(
            *launch.argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=launch.env,
            cwd=launch.cwd,
            start_new_session=True,
            preexec_fn=_make_controlling_tty,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    os.set_blocking(master, False)

    async def to_program(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(master, view) :]
            except BlockingIOError:
                await _fd_ready(master, write=True)

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
            to_program,
            on_resize=lambda w, h, pw, ph: _set_winsize(master, w, h, pw, ph),
            pid=proc.pid,
        ),
        name=f"pty-in->{proc.pid}",
    )
    output = asyncio.create_task(relay_output(), name=f"pty-out<-{proc.pid}")
    try:
        returncode = await _wait_program(process, proc)
        if returncode is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(output), PTY_DRAIN_SECONDS)
    finally:
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGHUP)
        feeder.cancel()
        output.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await output
        os.close(master)
    if returncode is not None:
        _exit(process, returncode)
