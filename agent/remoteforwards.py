"""Remote forwards as sshd does them: `ssh -R [ADDR:]PORT:...` (tcpip-forward) listens on the
box's loopback whatever address it asks for (sshd's GatewayPorts no), and `ssh -R
/path/in/box.sock:...` (streamlocal-forward) on a socket only the user can reach. Each
connection made to them is tunnelled back to the client by a forwards.Relay, so what the
client sends into the box through it counts as activity, as for -L."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncssh

from agent.activity import Activity
from agent.forwards import Relay, counter

log = logging.getLogger("devbox.agent")

# Addresses sshd (GatewayPorts no) binds a remote forward to as asked; any other one
# (0.0.0.0, *, "", localhost, a LAN address) gets the loopback addresses instead.
_EXPLICIT_LOOPBACK = {"127.0.0.1": socket.AF_INET, "::1": socket.AF_INET6}
# sshd's StreamLocalBindMask 0177: a remote forward's socket is the user's alone.
_SOCKET_MODE = 0o600


class _Listener(asyncssh.SSHListener):
    """A remote forward's listening sockets in the box. asyncssh closes it when the client
    cancels the forward or the connection ends; connections already made carry on."""

    def __init__(
        self, servers: list[asyncio.Server], *, port: int = 0, path: Path | None = None
    ) -> None:
        super().__init__()
        self._servers = servers
        self._port = port
        self._path = path
        # The socket file this forward made, by (device, inode): it removes that one only.
        self._made = _identity(path) if path is not None else None
        self.tasks: set[asyncio.Task[None]] = set()

    def get_port(self) -> int:
        return self._port

    def close(self) -> None:
        for server in self._servers:
            server.close()
        # sshd leaves the socket behind, and the next `ssh -R` to the same path (an editor
        # reconnecting, a laptop waking up) then fails until someone removes it by hand.
        if self._path is not None and self._made is not None:
            if _identity(self._path) == self._made:
                with contextlib.suppress(OSError):
                    self._path.unlink()
            self._made = None

    async def wait_closed(self) -> None:
        for server in self._servers:
            await server.wait_closed()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _tunnel_back(
    open_channel: Callable[[Relay, asyncio.Transport], Awaitable[object]], listener: _Listener
) -> Callable[[Relay, asyncio.Transport], None]:
    """What a connection accepted in the box does: open its channel to the client; the
    socket is read once that is open, and closed when the client refuses it."""

    async def tunnel(relay: Relay, transport: asyncio.Transport) -> None:
        try:
            await open_channel(relay, transport)
        except (asyncssh.Error, OSError) as exc:
            log.info("remote forward: the client refused a connection: %s", exc)
            transport.close()

    def connected(relay: Relay, transport: asyncio.Transport) -> None:
        task = asyncio.get_running_loop().create_task(tunnel(relay, transport))
        listener.tasks.add(task)
        task.add_done_callback(listener.tasks.discard)

    return connected


def _loopback_socket(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _loopback_sockets(listen_host: str, listen_port: int) -> list[socket.socket]:
    """sshd's GatewayPorts no: 127.0.0.1 or ::1 when asked for by address, else both
    (::1 where the box has IPv6); port 0 takes one free port for both."""
    family = _EXPLICIT_LOOPBACK.get(listen_host)
    wanted = [(listen_host, family)] if family else list(_EXPLICIT_LOOPBACK.items())
    socks: list[socket.socket] = []
    port = listen_port
    first: OSError | None = None
    for host, fam in wanted:
        try:
            socks.append(_loopback_socket(fam, host, port))
        except OSError as exc:
            first = first or exc
            continue
        port = int(socks[0].getsockname()[1])
    if not socks:
        assert first is not None
        raise first
    return socks


async def listen_tcp(
    conn: asyncssh.SSHServerConnection, listen_host: str, listen_port: int, *, activity: Activity
) -> asyncssh.SSHListener:
    """`ssh -R [ADDR:]PORT:...`: a listener on the box's loopback whose connections are
    tunnelled back to the client; raises OSError (the client hears the forward failed)."""
    socks = _loopback_sockets(listen_host, listen_port)
    port = int(socks[0].getsockname()[1])
    count = counter(activity)
    servers: list[asyncio.Server] = []
    listener = _Listener(servers, port=port)

    def open_channel(relay: Relay, transport: asyncio.Transport) -> Awaitable[object]:
        peer = transport.get_extra_info("peername")
        orig = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else ("", 0)
        # The address as the client asked for it: OpenSSH matches its forward by it.
        return conn.create_connection(lambda: relay, listen_host, port, *orig)

    connected = _tunnel_back(open_channel, listener)
    loop = asyncio.get_running_loop()
    try:
        for sock in socks:
            servers.append(
                await loop.create_server(
                    lambda: Relay(count, on_connect=connected).protocol, sock=sock
                )
            )
    except BaseException:
        listener.close()
        for sock in socks:
            sock.close()
        raise
    return _unless_closed(conn, listener)


def _unix_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Linux gives the bound file the socket's own mode: no moment when others can connect.
        os.fchmod(sock.fileno(), _SOCKET_MODE)
        try:
            sock.bind(str(path))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or not _stale(path):
                raise
            path.unlink()  # left by a forward whose agent was killed: nobody listens
            sock.bind(str(path))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _stale(path: Path) -> bool:
    """A socket file nobody listens on (a live one, even with a full backlog, is kept)."""
    if _identity(path) is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        return probe.connect_ex(str(path)) == errno.ECONNREFUSED


async def listen_unix(
    conn: asyncssh.SSHServerConnection, listen_path: str, *, home: str, activity: Activity
) -> asyncssh.SSHListener:
    """`ssh -R /path/in/box.sock:...`: a socket (mode 0600, relative to the session's home)
    whose connections are tunnelled back; removed when the forward ends."""
    path = Path(home, listen_path)
    sock = _unix_socket(path)
    count = counter(activity)
    servers: list[asyncio.Server] = []
    listener = _Listener(servers, path=path)
    connected = _tunnel_back(
        lambda relay, _: conn.create_unix_connection(lambda: relay, listen_path), listener
    )
    try:
        servers.append(
            await asyncio.get_running_loop().create_unix_server(
                lambda: Relay(count, on_connect=connected).protocol, sock=sock
            )
        )
    except BaseException:
        sock.close()
        listener.close()
        raise
    return _unless_closed(conn, listener)


def _unless_closed(conn: asyncssh.SSHServerConnection, listener: _Listener) -> _Listener:
    # A listener made after the connection closed would never be closed by it.
    if conn.is_closed():
        listener.close()
        raise OSError(errno.ECONNABORTED, "SSH connection closed")
    return listener
