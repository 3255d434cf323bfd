"""Connections that have not authenticated yet: how many the agent holds, which one goes
when there are too many, who the kernel says each peer is, and how little of it is logged.

sshd's MaxStartups and LoginGraceTime, redone for a server whose owner must always get in:
anyone who can reach the port (any local user, any pod) can open connections and send
nothing. Refusing newcomers at a cap, as sshd's MaxStartups does, lets a held flood lock
the owner out; so a newcomer is always taken, and when the cap is reached one older
unauthenticated connection is dropped instead: from the peer that holds the most, the one
that has got least far (not yet asking to authenticate), the oldest of those. A flood then
only ever evicts its own connections, and the owner's login, which is the newest and soon
past key exchange, survives it. Each connection also has a short grace time to log in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

# At most this many connections wait unauthenticated; sshd's MaxStartups starts refusing
# at 10 and refuses all at 100. The owner's tools open a few at once (VS Code, a TUI), so
# well above that, and still a small, fixed number of descriptors (one each).
MAX_PREAUTH = 64
# sshd's LoginGraceTime is 120 s. The owner's client authenticates in well under a second
# on loopback and in a few over a port-forward; a claim may add one read of the pod.
LOGIN_GRACE = 20.0
# Refused, evicted and timed-out connections are counted and logged once per interval.
SUMMARY_INTERVAL = 60.0
# Lines of detail (a refused key's fingerprint) logged per interval before counting only.
DETAILS_PER_INTERVAL = 3

log = logging.getLogger("devbox.agent.preauth")


class Abortable(Hashable, Protocol):
    def abort(self) -> None: ...


# --- who the peer is ------------------------------------------------------------------

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
# struct inet_diag_msg: family, state, timer, retrans (4 bytes), inet_diag_sockid (48),
# expires, rqueue, wqueue (12), then uid.
_DIAG_UID_OFFSET = 4 + 48 + 12
_NLMSG_HEADER = 16


def peer_of(peername: Any, sockname: Any) -> str:
    """A label for the peer that the kernel vouches for, never one the client chose.

    Over loopback every peer has the same address, but it is a local process, and the
    kernel knows which user owns its socket: that user is the peer. Otherwise the peer is
    its address (a pod, a host)."""
    if not peername or not sockname:
        return "unknown"
    host = _plain(str(peername[0]))
    if not _is_loopback(host):
        return host
    uid = socket_uid(host, int(peername[1]), _plain(str(sockname[0])), int(sockname[1]))
    return "loopback" if uid is None else f"uid {uid}"


def _plain(host: str) -> str:
    """An IPv4 peer on an IPv6 socket (::ffff:a.b.c.d) as the IPv4 address it is."""
    with contextlib.suppress(ValueError):
        mapped = ipaddress.ip_address(host.split("%")[0])
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            return str(mapped.ipv4_mapped)
    return host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def socket_uid(peer_host: str, peer_port: int, local_host: str, local_port: int) -> int | None:
    """The uid that owns the peer's end of a loopback TCP connection, or None.

    Asks the kernel's sock_diag netlink interface (what `ss` uses) for that one socket: an
    exact lookup, where reading /proc/net/tcp costs milliseconds per connection once a
    flood holds thousands of sockets. The peer's socket is the one whose source is the
    peer's address and whose destination is ours."""
    try:
        family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
        sockid = struct.pack(
            "!HH16s16s",
            peer_port,
            local_port,
            socket.inet_pton(family, peer_host).ljust(16, b"\0"),
            socket.inet_pton(family, local_host).ljust(16, b"\0"),
        ) + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
        header = struct.pack(
            "=IHHII", _NLMSG_HEADER + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0
        )
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.send(header + request)
            # The kernel answers within send(): the reply is already queued.
            reply = nl.recv(4096, socket.MSG_DONTWAIT)
    except (OSError, ValueError):
        return None
    if len(reply) < _NLMSG_HEADER + _DIAG_UID_OFFSET + 4:
        return None
    kind = struct.unpack_from("=H", reply, 4)[0]
    if kind == _NLMSG_ERROR:
        return None  # no such socket: the peer is gone already
    uid: int = struct.unpack_from("=I", reply, _NLMSG_HEADER + _DIAG_UID_OFFSET)[0]
    return uid


# --- what is logged -------------------------------------------------------------------


class Tally:
    """Counts what unauthenticated peers did and logs it as one line per interval.

    A flood must not grow the agent's log without bound: per connection, nothing is logged;
    the first few events that carry a useful detail (a refused key) are, per interval."""

    def __init__(
        self,
        logger: logging.Logger = log,
        *,
        interval: float = SUMMARY_INTERVAL,
        details: int = DETAILS_PER_INTERVAL,
    ) -> None:
        self._log = logger
        self._interval = interval
        self._details = details
        self._details_left = details
        self._events: collections.Counter[str] = collections.Counter()
        self._peers: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, event: str, peer: str, detail: str | None = None) -> None:
        self._events[event] += 1
        self._peers[peer] += 1
        if detail is not None and self._details_left > 0:
            self._details_left -= 1
            self._log.warning("%s (%s)", detail, peer)
        if self._timer is None:
            with contextlib.suppress(RuntimeError):  # no loop: flushed by the next note
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self._interval, self.flush)

    def flush(self) -> None:
        self._timer = None
        self._details_left = self._details
        if not self._events:
            return
        counts = ", ".join(f"{n} {event}" for event, n in self._events.most_common())
        peer, n = self._peers.most_common(1)[0]
        self._log.warning(
            "unauthenticated connections in the last %.0f s: %s; most from %s (%d)",
            self._interval,
            counts,
            peer,
            n,
        )
        self._events.clear()
        self._peers.clear()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.flush()


# --- how many wait --------------------------------------------------------------------


@dataclass
class _Pending:
    peer: str
    since: float
    asked: bool = False  # has asked to authenticate: past key exchange


class Gate:
    """The unauthenticated connections, oldest first, and the cap on how many there are."""

    def __init__(
        self,
        tally: Tally,
        *,
        limit: int = MAX_PREAUTH,
        grace: float = LOGIN_GRACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tally = tally
        self._limit = limit
        self._grace = grace
        self._clock = clock
        self._pending: dict[Abortable, _Pending] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def grace(self) -> float:
        """Seconds a connection has to authenticate (the server's login timeout)."""
        return self._grace

    def admit(self, conn: Abortable, peer: str) -> None:
        """Take a new connection, first making room for it if the cap is reached."""
        while len(self._pending) >= self._limit:
            victim = self._victim(peer)
            gone = self._pending.pop(victim)
            self._tally.note("evicted", gone.peer)
            victim.abort()  # no goodbye: nothing more is sent to a flood
        self._pending[conn] = _Pending(peer, self._clock())

    def _victim(self, newcomer: str) -> Abortable:
        held = collections.Counter(p.peer for p in self._pending.values())
        held[newcomer] += 1
        most = max(held.values())
        # The peer holding the most; of its connections the oldest not yet past key
        # exchange, else its oldest. The dict is in age order and min() keeps the first.
        # (Never empty: if only the newcomer's peer reaches `most`, it holds `most - 1`
        # here, and `most` is 1 only when every peer holds one.)
        mine = [c for c, p in self._pending.items() if held[p.peer] == most]
        return min(mine, key=lambda c: self._pending[c].asked)

    def asked(self, conn: Abortable) -> None:
        """The client has finished key exchange and asks to authenticate."""
        pending = self._pending.get(conn)
        if pending is not None:
            pending.asked = True

    def authenticated(self, conn: Abortable) -> None:
        self._pending.pop(conn, None)

    def lost(self, conn: Abortable) -> None:
        """The connection closed; if before authenticating (and not evicted), say how."""
        pending = self._pending.pop(conn, None)
        if pending is None:
            return
        timed_out = self._clock() - pending.since >= self._grace - 0.5
        self._tally.note("timed out" if timed_out else "closed", pending.peer)
