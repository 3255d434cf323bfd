"""devbox's own SSH client (asyncssh): `devbox ssh` and the attach after `devbox up`.

It pins the host key from the box record and offers only the user's devbox key,
so it needs no OpenSSH installed, and fails with one clear line when the box
is unreachable, answers with another host key, or refuses the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import termios
import threading
import tty
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from devbox import paths, protocol
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh import openssh
from devbox.ssh._asyncssh import asyncssh

CHUNK = 256 * 1024


class _Presented(asyncssh.SSHClient):
    """Keeps the host key a box presented that was not the pinned one, to name it."""

    def __init__(self) -> None:
        self.key: asyncssh.SSHKey | None = None

    def validate_host_public_key(
        self, host: str, addr: str, port: int, key: asyncssh.SSHKey
    ) -> bool:
        self.key = key
        return False


async def connect(
    box: Box, sock: socket.socket, *, key_file: Path | None = None, username: str | None = None
) -> asyncssh.SSHClientConnection:
    if key_file is None:
        # The checks OpenSSH's path makes too: one door, one set of answers.
        openssh.preflight(box)
    key_file = key_file or paths.user_key_file()
    try:
        pinned = asyncssh.import_public_key(box.host_key)
    except (asyncssh.KeyImportError, ValueError):
        raise DevboxError(f"box {box.name} has no valid pinned host key in its record") from None
    presented = _Presented()
    try:
        return await asyncssh.connect(
            sock=sock,
            host=f"{box.name}.devbox",
            username=username or box.owner,
            client_factory=lambda: presented,
            client_keys=[str(key_file)],
            known_hosts=([pinned], [], []),
            agent_path=None,
            config=None,
            preferred_auth="publickey",
            # The box's own config knobs stay out: this client is self-contained.
            ignore_encrypted=True,
            login_timeout=20,
        )
    except asyncssh.HostKeyNotVerifiable:
        sent = presented.key.get_fingerprint("sha256") if presented.key else "another key"
        raise DevboxError(
            f"box {box.name} presented a host key that does not match the pinned "
            f"{box.host_key_fingerprint} (it presented {sent}); refusing to connect: "
            "something else may be answering at its address"
        ) from None
    except asyncssh.PermissionDenied:
        raise DevboxError(f"box {box.name} refused your key {key_file}") from None
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise DevboxError(f"cannot use your key {key_file}: {exc}") from None
    except (asyncssh.Error, OSError) as exc:
        raise DevboxError(f"cannot reach box {box.name}: {exc}") from None


def _exit_status(process: asyncssh.SSHClientProcess[bytes], box: str) -> int:
    if process.exit_status is not None and process.exit_status >= 0:
        return process.exit_status
    if process.exit_signal:
        return 255  # as OpenSSH's ssh does for a command killed by a signal
    # No status at all: the box went away under the command (shut down, crashed).
    raise DevboxError(f"lost the connection to box {box} before the command finished")


def _stdin_reader(write: Callable[[bytes | None], None]) -> None:
    """Blocking reads in a thread: an event-loop reader would set O_NONBLOCK on a
    terminal the parent shell shares, and a regular file cannot be watched."""
    try:
        while data := os.read(0, CHUNK):
            write(data)
    except OSError:
        pass
    write(None)


async def _relay(reader: asyncssh.SSHReader[bytes], fd: int) -> None:
    while chunk := await reader.read(CHUNK):
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


async def run_command(conn: asyncssh.SSHClientConnection, command: str | None, box: str) -> int:
    """Run `command` as `ssh host command` would: stdin, stdout, stderr and status pass through.
    None runs the login shell on stdin, as `ssh -T host` does."""
    process = await conn.create_process(command, encoding=None)
    loop = asyncio.get_running_loop()

    def feed(data: bytes | None) -> None:
        if data is None:
            process.stdin.write_eof()
        else:
            process.stdin.write(data)

    def from_thread(data: bytes | None) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed: the command ended
            loop.call_soon_threadsafe(feed, data)

    threading.Thread(target=_stdin_reader, args=(from_thread,), daemon=True).start()

    await asyncio.gather(_relay(process.stdout, 1), _relay(process.stderr, 2))
    await process.wait_closed()
    return _exit_status(process, box)


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSADRAIN)  # TCSAFLUSH would drop what was typed ahead
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def interactive(conn: asyncssh.SSHClientConnection, command: str | None, box: str) -> int:
    """A terminal session: raw local tty, remote PTY, window-size changes forwarded."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise DevboxError("an interactive session needs a terminal; pass a command after --")
    size = os.get_terminal_size(1)
    env = {k: v for k, v in os.environ.items() if k == "LANG" or k.startswith("LC_")}
    process = await conn.create_process(
        command,
        term_type=os.environ.get("TERM", "xterm-256color"),
        term_size=(size.columns, size.lines),
        encoding=None,
        env=env,
    )
    loop = asyncio.get_running_loop()

    def on_resize() -> None:
        new = os.get_terminal_size(1)
        process.change_terminal_size(new.columns, new.lines)

    def on_input() -> None:
        # Readable means at least one byte waits: this read does not block.
        data = os.read(0, CHUNK)
        if data:
            process.stdin.write(data)

    with _raw_terminal(0):
        loop.add_signal_handler(signal.SIGWINCH, on_resize)
        loop.add_reader(0, on_input)
        try:
            await asyncio.gather(_relay(process.stdout, 1), _relay(process.stderr, 2))
            await process.wait_closed()
        finally:
            loop.remove_reader(0)
            loop.remove_signal_handler(signal.SIGWINCH)
    return _exit_status(process, box)


@contextlib.asynccontextmanager
async def session(box: Box, sock: socket.socket) -> AsyncIterator[asyncssh.SSHClientConnection]:
    """An authenticated connection to `box` over `sock` for the body, closed after it.
    Every way it fails is one DevboxError naming the box: connecting (see connect), the
    connection dropping, or the box sending a frame its type does not allow."""
    conn = await connect(box, sock)
    try:
        yield conn
    except (asyncssh.ConnectionLost, asyncssh.DisconnectError) as exc:
        raise DevboxError(f"lost the connection to box {box.name}: {exc.reason}") from None
    except protocol.ProtocolError as exc:
        raise DevboxError(f"box {box.name}: {exc.message}") from None
    finally:
        conn.close()
        # close() aborts the transport, so this is short: the connection's own callbacks
        # run before asyncio.run closes the loop.
        with contextlib.suppress(Exception):
            await conn.wait_closed()


def probe(box: Box, sock: socket.socket) -> None:
    """Connect and authenticate, run nothing: raises the one-line DevboxError of a failure."""

    async def main() -> None:
        async with session(box, sock):
            pass

    asyncio.run(main())


def run(box: Box, sock: socket.socket, command: str | None, *, interactive_: bool) -> int:
    """Connect to `box` over `sock` and run `command` (None: the persistent session)."""

    async def main() -> int:
        async with session(box, sock) as conn:
            if interactive_:
                return await interactive(conn, command, box.name)
            return await run_command(conn, command, box.name)

    return asyncio.run(main())


def capture(box: Box, sock: socket.socket, command: str) -> tuple[int, bytes, bytes]:
    """Run `command` with no input; its exit status, stdout and stderr (`devbox runs`)."""

    async def main() -> tuple[int, bytes, bytes]:
        async with session(box, sock) as conn:
            result = await conn.run(command, encoding=None, stdin=asyncssh.DEVNULL)
        out, err = result.stdout or b"", result.stderr or b""
        status = result.exit_status if result.exit_status is not None else 255
        assert isinstance(out, bytes) and isinstance(err, bytes)  # encoding=None
        return status, out, err

    return asyncio.run(main())
