"""The agent's SSH server: owner-only public-key auth, shells joined to the box's
persistent session, exec, SFTP, and port forwarding."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pwd
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
from asyncssh.kex import get_kex_algs
from asyncssh.mac import get_mac_algs

from agent import forwards, pqkex, preauth, remoteforwards, shell, sshspeed
from agent.agentfwd import AgentRelay
from agent.probehub import ProbeHub
from agent.services import AgentServices
from agent.sftp import SFTPServer
from devbox import protocol
from devbox.boxes import Multiplexer
from devbox.runs.record import MULTIPLEXER_ENV, PYTHON_ENV, RUNS_ENV, RUNS_FOLDER

log = logging.getLogger("devbox.agent")

# Variables the agent inherited that would confuse a session started from it. SHLVL
# among them: bash reads ~/.bashrc for `ssh host CMD` (Debian's SSH_SOURCE_BASHRC, how
# conda and pyenv reach remote commands) only as a top-level shell, as under sshd.
_DROP_ENV = (
    "SHLVL",
    "PWD",
    "OLDPWD",
    "_",
    "STY",
    "WINDOW",
    "TMUX",
    "TMUX_PANE",
    "SSH_AUTH_SOCK",
    "SSH_CONNECTION",
    "SSH_CLIENT",
    "SSH_TTY",
    "DEVBOX_AGENT_READY_FD",
)
# Client-sent variables accepted, as OpenSSH's default AcceptEnv LANG LC_*.
_ACCEPT_ENV_PREFIXES = ("LANG", "LC_")
# What the agent offers, chosen so that ssh-audit finds no failure (asyncssh's defaults
# fail 9 checks: SHA-1, 1024-bit group exchange, NIST curves) and every client devbox
# meets connects: OpenSSH >= 6.5 (scp, sftp, rsync, git, VS Code), asyncssh, paramiko >= 2.7.
# Key exchange: the post-quantum hybrids first where this asyncssh has them (mlkem768 for
# devbox's own client and OpenSSH >= 9.9, through `cryptography`; sntrup761 for OpenSSH
# 8.5-9.8, Debian 12's 9.2 among them, through liboqs or the `pqcrypto` wheel: agent.pqkex),
# then X25519. No finite-field Diffie-Hellman: it would let any unauthenticated
# peer make the agent do a 4096-bit modular exponentiation for free (DHEat, CVE-2002-20001),
# and every client above has X25519. asyncssh adds kex-strict-s-v00@openssh.com itself
# (Terrapin, CVE-2023-48795) and ext-info-s.
_KEX_WANTED = (
    "mlkem768x25519-sha256",
    "sntrup761x25519-sha512",
    "sntrup761x25519-sha512@openssh.com",
    "curve25519-sha256",
    "curve25519-sha256@libssh.org",
)
_CIPHERS = [
    "aes128-ctr",
    "aes256-ctr",
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "aes192-ctr",
]
# What an OpenSSH client (>= 6.2) is offered: it would take AES-CTR and a MAC from the list
# above, which costs both sides more CPU a byte (agent.sshspeed).
_OPENSSH_CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]
# For clients on AES-CTR (OpenSSH, on AES-GCM, needs no MAC): encrypt-then-MAC first; the
# plain SHA-2 MACs stay for clients with AES-CTR and no EtM (older Go x/crypto/ssh and
# JSch). No SHA-1, no 64-bit tags.
_MACS = [
    "umac-128-etm@openssh.com",
    "hmac-sha2-256-etm@openssh.com",
    "hmac-sha2-512-etm@openssh.com",
    "hmac-sha2-256",
    "hmac-sha2-512",
]


@dataclass(kw_only=True)
class BoxIdentity:
    name: str
    home: Path
    # None until a claim names the owner (a warm pod): every key is refused meanwhile.
    owner_key: asyncssh.SSHKey | None
    multiplexer: Multiplexer
    gpu_env: str | None  # CUDA_VISIBLE_DEVICES for sessions; None leaves it unset
    # False when the user chose "none": a plain shell is then what they asked for.
    warn_without_multiplexer: bool = True
    # In a pod, `home` is the owner's persistent home and sessions get it as $HOME (the
    # image's own home is lost with the pod); a local box keeps the user's $HOME.
    home_is_home: bool = False

    @property
    def runs_dir(self) -> Path:
        # Asked each time: a warm pod's home is known only once it is claimed.
        return self.home / RUNS_FOLDER


class Agent:
    def __init__(
        self,
        box: BoxIdentity,
        services: AgentServices,
        *,
        refresh_owner: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.box = box
        self.activity = services.activity
        self.telemetry = services.telemetry
        self.probe_hub = services.probe_hub
        # In a pod: re-reads the owner from the pod, for a key the watch has not brought yet.
        self.refresh_owner = refresh_owner
        self._tasks = services.tasks
        self.connections: set[asyncssh.SSHServerConnection] = set()
        # The channels' own tasks (asyncssh starts them): ended when the box shuts down.
        self.channel_tasks: set[asyncio.Task[Any]] = set()
        # Unauthenticated connections: capped, counted, logged once per interval.
        self.preauth_log = preauth.Tally()
        self.gate = preauth.Gate(self.preauth_log)
        # The persistent session's SSH_AUTH_SOCK, started with the first terminal client.
        self.agent_relay = AgentRelay(box=box.name, home=box.home)

    # --- sessions -------------------------------------------------------------------

    @property
    def _user(self) -> pwd.struct_passwd:
        # Asked each time: an in-pod agent becomes its owner's uid after it starts.
        return pwd.getpwuid(os.getuid())

    @property
    def session_home(self) -> str:
        """A session's $HOME, where it starts and what `~` means to scp and SFTP: the
        user's own on a local box (the agent's), the owner's persistent home in a pod."""
        if self.box.home_is_home:
            return str(self.box.home)
        return os.environ.get("HOME") or self._user.pw_dir

    def session_env(self, process: shell.Process) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env.update(
            USER=self._user.pw_name,
            LOGNAME=self._user.pw_name,
            SHELL=self.login_shell,
            **{protocol.BOX_ENV: self.box.name},
            HOME=self.session_home,
        )
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        if self.box.gpu_env is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.box.gpu_env
        env.update(self.run_env())
        if self.probe_hub is not None:  # where devbox.probe in a training process connects
            env[protocol.PROBE_SOCKET_ENV] = str(self.probe_hub.path)
        # Where it finds the agent after this one restarts (agent.main writes the file).
        env[protocol.PROBE_POINTER_ENV] = str(self.box.home / protocol.PROBE_POINTER_FILE)
        for key, value in process.env.items():
            if (
                isinstance(key, str)
                and isinstance(value, str)
                and key.startswith(_ACCEPT_ENV_PREFIXES)
            ):
                env[key] = value
        peer = process.get_extra_info("peername")
        sock = process.get_extra_info("sockname")
        if peer and sock:
            env["SSH_CONNECTION"] = f"{peer[0]} {peer[1]} {sock[0]} {sock[1]}"
            env["SSH_CLIENT"] = f"{peer[0]} {peer[1]} {sock[1]}"
        if forwarded := _forwarded_agent(process):  # the persistent session's: in _run
            env["SSH_AUTH_SOCK"] = forwarded[1]
        term = process.get_terminal_type()
        if term:
            env["TERM"] = term
        return env

    def run_env(self) -> dict[str, str]:
        """What `devbox run`'s in-box helper needs: this interpreter (which has devbox,
        whatever PATH says), the box's runs folder, and the multiplexer of its session."""
        return {
            PYTHON_ENV: sys.executable,
            RUNS_ENV: str(self.box.runs_dir),
            MULTIPLEXER_ENV: self.box.multiplexer.kind,
        }

    def sftp_server(self, chan: asyncssh.SSHServerChannel[bytes]) -> SFTPServer:
        """The SFTP (and `scp -O`) server of one channel."""
        return SFTPServer(chan, home=self.session_home, activity=self.activity)

    @property
    def login_shell(self) -> str:
        return self._user.pw_shell or "/bin/sh"

    async def handle(self, process: shell.Process) -> None:
        """One SSH channel: a shell (joined to the persistent session) or a command."""
        task = asyncio.current_task()
        if task:
            self.channel_tasks.add(task)
        log.info("session: %s", _describe(process))
        if process.subsystem is not None:
            # Not a user at work: a dashboard watching an idle box must not keep it alive.
            try:
                await self._subsystem(process, process.subsystem)
            finally:
                if task:
                    self.channel_tasks.discard(task)
            return
        self.activity.client(+1)
        try:
            await self._run(process)
        except Exception as exc:  # one broken channel must never take the agent down
            log.exception("session failed")
            process.stderr.write(f"devbox agent: {exc}\r\n".encode())
            process.exit(255)
        finally:
            self.activity.client(-1)
            if task:
                self.channel_tasks.discard(task)

    async def _subsystem(self, process: shell.Process, name: str) -> None:
        if name == protocol.PROBE_SUBSYSTEM and self.probe_hub is not None:
            await self._probe_subsystem(process, self.probe_hub)
            return
        if name != protocol.TELEMETRY_SUBSYSTEM:
            process.stderr.write(f"devbox agent: no subsystem {name!r}\r\n".encode())
            process.exit(1)
            return
        await _serve_frames(process, self.telemetry.serve)

    async def _probe_subsystem(self, process: shell.Process, hub: ProbeHub) -> None:
        await _serve_frames(process, hub.serve)

    async def _run(self, process: shell.Process) -> None:
        env = self.session_env(process)
        pty = process.get_terminal_type() is not None
        command = process.command
        joins = pty and command is None and self.box.multiplexer.kind != "none"
        if joins and (stable := await self.agent_relay.start()) is not None:
            # Every attaching client passes it on, so tmux's update-environment keeps it too.
            env["SSH_AUTH_SOCK"] = str(stable)
        if command is not None:
            argv = [self.login_shell, "-c", command]
        elif pty:
            argv = self.box.multiplexer.attach_argv(self.box.name) or [self.login_shell, "-l"]
            if self.box.multiplexer.kind == "none" and self.box.warn_without_multiplexer:
                process.stderr.write(
                    b"devbox: warning: neither screen nor tmux is installed in this box; "
                    b"this shell ends when you disconnect\r\n"
                )
        else:
            argv = [self.login_shell, "-l"]
        # Keys in a terminal are a person; a script on stdin or a pipe counts past the floor.
        on_input = self.activity.keys if pty else functools.partial(self.activity.traffic, "exec")
        if command is not None:
            self.activity.input()  # someone ran a command (ssh host CMD, scp, rsync, git)
        launch = shell.Launch(
            argv=argv, env=env, cwd=self._start_folder(process, env), on_input=on_input
        )
        if not pty:
            await shell.run_on_pipes(process, launch, tasks=self._tasks)
            return
        # A terminal client that forwarded an agent is the one the stable socket reaches.
        forwarded = _forwarded_agent(process)
        token = self.agent_relay.attach(forwarded[0]) if forwarded else None
        try:
            await shell.run_on_pty(process, launch, tasks=self._tasks)
        finally:
            if token is not None:
                self.agent_relay.detach(token)

    @staticmethod
    def _start_folder(process: shell.Process, env: dict[str, str]) -> str:
        """$HOME, as sshd; "/" (and sshd's complaint) when it is not there."""
        home = env["HOME"]
        if os.path.isdir(home):
            return home
        process.stderr.write(f"Could not chdir to home directory {home}\r\n".encode())
        return "/"


async def _serve_frames(process: shell.Process, serve: Callable[..., Awaitable[int]]) -> None:
    """One frame stream (telemetry, probe) on its channel. Whatever goes wrong in it ends
    this channel with an ERROR frame: an exception let out of here would make asyncssh
    drop the whole connection, and with it the user's other channels."""
    try:
        status = await serve(
            read=process.stdin.read, write=process.stdout.write, drain=process.stdout.drain
        )
    except (asyncssh.Error, OSError, BrokenPipeError):
        return  # the subscriber went away mid-write
    except Exception as exc:
        log.exception("a %s stream failed", process.subsystem)
        with contextlib.suppress(asyncssh.Error, OSError):
            process.stdout.write(protocol.encode(protocol.ERROR, message=f"agent error: {exc}"))
        status = 1
    process.exit(status)


def _describe(process: shell.Process) -> str:
    """What a session is, for the log, without what it runs: a command line can carry a
    token (`TOKEN=... cmd`, `curl -H ...`), so not even its first word is logged."""
    if process.subsystem is not None:
        return f"subsystem {process.subsystem[:32]!r}"
    if process.command is not None:
        return f"exec ({len(process.command.encode())} bytes)"
    return "shell" if process.get_terminal_type() is not None else "shell without a terminal"


def _forwarded_agent(process: shell.Process) -> tuple[asyncssh.SSHServerConnection, str] | None:
    """The session's connection and its agent socket when the client forwarded one (-A)."""
    conn = process.get_extra_info("connection")
    if not isinstance(conn, asyncssh.SSHServerConnection):
        return None
    path = conn.get_agent_path()
    return None if path is None else (conn, path)


def _ack_at_once(conn: asyncssh.SSHServerConnection, *, stop: bool = False) -> None:
    """Until the client is authenticated, acknowledge what it sends at once.

    OpenSSH leaves Nagle's algorithm on until then, so a small write that follows another
    waits for the first one's ACK, and Linux delays ACKs by up to 40 ms: 50 to 80 ms of
    every local `devbox ssh` went there. TCP_QUICKACK makes the next ACKs immediate; Linux
    resets it, so it is set again after every read. After authentication OpenSSH turns
    on TCP_NODELAY for an interactive session, and a bulk copy needs no syscall per read."""
    if stop:
        with contextlib.suppress(AttributeError):
            del conn.data_received  # the class's method again
        return
    sock = conn.get_extra_info("socket")
    quick = getattr(socket, "TCP_QUICKACK", None)
    if quick is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    received = conn.data_received

    def data_received(*args: Any) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, quick, 1)
        received(*args)

    # asyncio's transport looks the method up on every read: an instance attribute wins.
    setattr(conn, "data_received", data_received)  # noqa: B010 (mypy: no method assignment)


class _Server(asyncssh.SSHServer):
    """Per-connection policy. Only public keys, only the owner's."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._conn: asyncssh.SSHServerConnection | None = None
        self._peer = "unknown"
        self._refreshed = False

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._peer = preauth.peer_of(
            conn.get_extra_info("peername"), conn.get_extra_info("sockname")
        )
        self._agent.gate.admit(conn, self._peer)
        self._agent.connections.add(conn)
        _ack_at_once(conn)

    def auth_completed(self) -> None:
        if self._conn is not None:
            self._agent.gate.authenticated(self._conn)
            _ack_at_once(self._conn, stop=True)
        log.info("owner logged in (%s)", self._peer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._agent.gate.lost(self._conn)
            self._agent.connections.discard(self._conn)

    def begin_auth(self, username: str) -> bool:
        if self._conn is not None:
            self._agent.gate.asked(self._conn)
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    async def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        accepted = self._is_owner(key)
        refresh = self._agent.refresh_owner
        if not accepted and refresh is not None and not self._refreshed:
            # A claimer connects as soon as its claim is written, which is often before
            # the pod watch has brought it here: look at the pod once per connection.
            self._refreshed = True
            await refresh()
            accepted = self._is_owner(key)
        if not accepted:
            # Counted, and logged in full only a few times per interval: anyone may offer
            # keys. The user name is the client's word: cut short and quoted.
            self._agent.preauth_log.note(
                "keys refused",
                self._peer,
                f"refused key {key.get_fingerprint()} for {username[:32]!r}: not the owner's",
            )
        return accepted

    def _is_owner(self, key: asyncssh.SSHKey) -> bool:
        owner = self._agent.box.owner_key
        return owner is not None and key.public_data == owner.public_data

    # Forwards are relayed by agent.forwards, so that the client's traffic through them
    # (VS Code's server connection and terminals, a notebook's port) counts as activity.

    def connection_requested(
        self, dest_host: str, dest_port: int, orig_host: str, orig_port: int
    ) -> bool | Awaitable[asyncssh.SSHTCPSession[bytes]]:
        if self._conn is None:  # ssh -L, -D, -W
            return False
        return forwards.open_tcp(self._conn, dest_host, dest_port, activity=self._agent.activity)

    def unix_connection_requested(
        self, dest_path: str
    ) -> bool | Awaitable[asyncssh.SSHUNIXSession[bytes]]:
        if self._conn is None:
            return False
        return forwards.open_unix(
            self._conn, dest_path, home=self._agent.session_home, activity=self._agent.activity
        )

    def server_requested(
        self, listen_host: str, listen_port: int
    ) -> bool | Awaitable[asyncssh.SSHListener]:
        if self._conn is None:  # ssh -R, on loopback whatever address it asks for
            return False
        return remoteforwards.listen_tcp(
            self._conn, listen_host, listen_port, activity=self._agent.activity
        )

    def unix_server_requested(self, listen_path: str) -> bool | Awaitable[asyncssh.SSHListener]:
        if self._conn is None:
            return False
        return remoteforwards.listen_unix(
            self._conn, listen_path, home=self._agent.session_home, activity=self._agent.activity
        )


async def serve(
    agent: Agent,
    *,
    sock: socket.socket,
    host_key: Path,
    stop: asyncio.Event,
    before_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> None:
    sshspeed.install(openssh_ciphers=_OPENSSH_CIPHERS)
    server = await asyncssh.listen(
        sock=sock,
        server_factory=lambda: _Server(agent),
        # Read once, here: an in-pod agent then becomes its owner's uid, and the file
        # stays root's (asyncssh would otherwise read it again for every connection).
        server_host_keys=[asyncssh.read_private_key(host_key)],
        process_factory=agent.handle,
        sftp_factory=agent.sftp_server,
        allow_scp=True,
        encoding=None,
        line_editor=False,
        agent_forwarding=True,  # ssh -A, as sshd's AllowAgentForwarding yes
        x11_forwarding=False,
        # Large windows: bulk copies are bound by round trips otherwise.
        window=8 * 1024 * 1024,
        # OpenSSH clients pick the first cipher of their own list that the server offers,
        # which is chacha20-poly1305; in asyncssh that runs at ~0.75x OpenSSH's speed.
        # Only AES then: every OpenSSH >= 6.2, VS Code, paramiko and asyncssh client
        # connects; an OpenSSH client is offered AES-GCM alone (sshspeed.install above).
        encryption_algs=_CIPHERS,
        kex_algs=_kex_algs(),
        mac_algs=_mac_algs(),
        login_timeout=agent.gate.grace,
        keepalive_interval=30,
    )
    log.info("serving %s on %s", agent.box.name, sock.getsockname())
    await stop.wait()
    log.info("shutting down")
    server.close()
    if before_disconnect is not None:
        try:
            await before_disconnect()
        except Exception:
            log.exception("ending the sessions failed")
    for conn in list(agent.connections):
        conn.disconnect(asyncssh.DISC_BY_APPLICATION, "box is shutting down")
    for task in list(agent.channel_tasks):
        task.cancel()
    await asyncio.gather(*agent.channel_tasks, return_exceptions=True)
    await agent.agent_relay.close()
    await server.wait_closed()
    agent.preauth_log.close()


def _mac_algs() -> list[str]:
    """The MACs wanted that this asyncssh has: UMAC needs libnettle, which a slim image may
    lack (naming it there made asyncssh refuse the whole configuration)."""
    have = {alg.decode() for alg in get_mac_algs()}
    return [alg for alg in _MACS if alg in have]


def _kex_algs() -> list[str]:
    """The key exchanges wanted that this asyncssh has (the hybrids depend on libraries:
    mlkem768 on `cryptography`, sntrup761 on liboqs or the `pqcrypto` wheel)."""
    pqkex.register()
    have = {alg.decode() for alg in get_kex_algs()}
    return [alg for alg in _KEX_WANTED if alg in have]
