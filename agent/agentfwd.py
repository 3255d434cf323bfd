"""`ssh -A` in a box's persistent session.

A command or a plain shell sees its own connection's forwarded agent, as under sshd. The
screen/tmux session outlives every client, so it gets one stable SSH_AUTH_SOCK instead
(what tmux users set up by hand with a symlink in ~/.ssh/rc): a socket the agent listens
on, which relays each connection to the agent of the most recently attached terminal
client that forwarded one, else the one before it still attached, else closes it at once.

The socket's folder is in the shared /tmp, so it is made 0700 in one step and checked
(a folder, not a link, this uid's, nobody else's bits) before anything is put in it; its
name is fixed per box (a hash of the box's home and name, so two HOMEs' "b1" differ) so
that a session kept across an agent restart still finds it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Protocol

import asyncssh

log = logging.getLogger("devbox.agent")

FOLDER_PREFIX = "devbox-agent-"
SOCKET_NAME = "agent.sock"
# Unix socket paths are at most 107 bytes; stay well under.
MAX_PATH = 100
CHUNK = 64 * 1024
# The agent protocol's one-byte SSH_AGENT_FAILURE message (draft-miller-ssh-agent), framed.
AGENT_FAILURE = b"\x00\x00\x00\x01\x05"
MAX_REQUEST = 256 * 1024
REFUSE_TIMEOUT = 5.0


def stable_path(*, box: str, home: Path, tmp: str | None = None) -> Path:
    """The box's stable agent socket: short, the same every time for this box and home."""
    digest = hashlib.sha256(f"{home}\0{box}".encode()).hexdigest()[:12]
    for base in (tmp or tempfile.gettempdir(), "/tmp"):
        path = Path(base) / f"{FOLDER_PREFIX}{box[:20]}-{digest}" / SOCKET_NAME
        if len(os.fsencode(path)) < MAX_PATH:
            return path
    return path


def private_folder(folder: Path) -> bool:
    """Whether `folder` is (now) a 0700 folder of this uid's, made in one step if missing."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False  # a link, a file, or another user's: someone could see or swap it
    if stat.S_IMODE(st.st_mode) & 0o077:
        return False  # others could have put something in it
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)  # a tight umask left us without write or search
    return True


class _Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def write_eof(self) -> None: ...


async def _pump(src: _Reader, dst: _Writer) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        while data := await src.read(CHUNK):
            dst.write(data)
            await dst.drain()
        dst.write_eof()


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """No agent to reach: the first request gets SSH_AGENT_FAILURE, then the socket closes.
    Closing before the request is read would kill a client that is still writing it with
    SIGPIPE (ssh-add does not ignore it); a plain failure is what it can report."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        async with asyncio.timeout(REFUSE_TIMEOUT):
            size = int.from_bytes(await reader.readexactly(4), "big")
            if size <= MAX_REQUEST:
                await reader.readexactly(size)
            writer.write(AGENT_FAILURE)
            await writer.drain()


class AgentRelay:
    def __init__(self, *, box: str, home: Path) -> None:
        self._box, self._home = box, home
        self.path: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Lock | None = None
        # (token, connection) of attached terminal clients that forwarded an agent, newest last.
        self._clients: list[tuple[object, asyncssh.SSHServerConnection]] = []
        self._relays: set[asyncio.Task[None]] = set()

    async def start(self) -> Path | None:
        """Listen on the stable socket (once; later calls return it); None when no private
        folder could be had for it, and then the session has no stable socket."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None:
                self.path = await self._listen()
        return self.path

    async def _listen(self) -> Path | None:
        path = stable_path(box=self._box, home=self._home)
        if not private_folder(path.parent):
            log.warning("%s is not a private folder: the session's agent socket is elsewhere",
                        path.parent)  # fmt: skip
            path = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX)) / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a killed agent's: nobody listens on it
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(path))
            os.chmod(path, 0o600)
        except OSError as exc:
            log.error("no agent socket for the session: %s", exc)
            return None
        return path

    def attach(self, conn: asyncssh.SSHServerConnection) -> object:
        """A terminal client whose connection forwarded an agent has attached; the token
        given back detaches it."""
        token = object()
        self._clients.append((token, conn))
        return token

    def detach(self, token: object) -> None:
        self._clients = [(t, c) for t, c in self._clients if t is not token]

    def _latest(self) -> asyncssh.SSHServerConnection | None:
        for _token, conn in reversed(self._clients):
            if not conn.is_closed() and conn.get_agent_path() is not None:
                return conn
        return None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._relay(reader, writer), name="agent-relay")
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            conn = self._latest()
            if conn is None:
                await _refuse(reader, writer)
                return
            try:
                up_reader, up_writer = await conn.open_agent_connection()
            except (OSError, asyncssh.Error):
                return
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()

    async def close(self) -> None:
        """Stop listening and remove the socket and its folder."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        self._server = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)
