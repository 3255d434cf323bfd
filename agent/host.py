"""The host half of a telemetry sample: CPU, memory, disk and network, and the box's processes.

Cost is the point of this module: the agent samples once per tick (1 Hz, up to 20 Hz while
a client streams) and the whole sampler must stay under 1% of one core at 1 Hz with a few
hundred box processes. One tick with 200 box processes, measured on a 2-core VM: 55 ms for
psutil.process_iter with attrs over the host, 31 ms for cached psutil.Process objects
read in oneshot(), 5 ms reading /proc/PID/stat (one file per process) directly. So on
Linux the per-process reads go straight to /proc, and psutil is the fallback elsewhere.
Host-wide figures come from psutil on both: a handful of calls per tick.

Which processes are the box's:
- all_processes (inside a pod, own PID namespace): everything visible.
- otherwise (a local box on a shared machine): the agent (root_pid) and its descendants,
  plus every process whose environment holds the box marker (DEVBOX_BOX=<name>) and its
  descendants. The marker catches the screen/tmux server, which daemonizes and is
  reparented to init, so descent from the agent alone would miss the user's session.

A process is judged once, when first seen: where it was forked and its initial environment
never change, so the verdict holds for its life. (A process first seen after its parent in
the box already exited has been reparented and is found only by the marker: an unmarked
double fork within one tick escapes.) Processes that are not the box's are never read
again; the box's are re-read every tick, and a changed start time there means the PID was
reused, which starts a new judgement. A stranger's PID reused between two ticks would pass
its verdict to the newcomer; that needs the kernel's cyclic PID allocator to wrap within
one tick, and is accepted.
"""

from __future__ import annotations

import os
import pwd
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import psutil

from devbox.protocol import BoxProcess, HostSample

CMDLINE_CHARS = 200
# UTF-8 needs at most 4 bytes a character: reading more is wasted on huge command lines.
_CMDLINE_BYTES = 4 * CMDLINE_CHARS
# A command line changes on exec, which almost always changes the name too (and then it
# is re-read at once), or through setproctitle; re-reading it every tick would cost a
# third of a box process's sampling at 20 Hz for what is nearly always the same text.
CMDLINE_TTL = 5.0
# The kernel truncates a process name (comm) to 15 bytes; psutil then takes argv[0].
_COMM_MAX = 15
# Whether this system has a Linux /proc; tests switch it off to exercise the psutil path.
_PROCFS = os.path.exists("/proc/self/stat")


class _Gone(Exception):
    """The process exited (or became unreadable) between listing and reading."""


class _Stat(NamedTuple):
    ppid: int
    start: float  # with the PID, identifies one process across reads
    comm: str
    zombie: bool
    cpu_s: float  # user + system seconds
    rss: int
    threads: int
    uid: int | None


class _Procfs:
    """Reads /proc directly: one open and read of /proc/PID/stat per process per tick."""

    def __init__(self) -> None:
        self._ticks = float(os.sysconf("SC_CLK_TCK"))
        self._page = os.sysconf("SC_PAGE_SIZE")

    def pids(self) -> set[int]:
        return {int(name) for name in os.listdir("/proc") if name.isdigit()}

    def stat(self, pid: int) -> _Stat:
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except OSError:
            raise _Gone from None
        try:
            data = os.read(fd, 4096)
            # The file's owner is the process's effective uid: no extra open of status.
            uid = os.fstat(fd).st_uid
        except OSError:
            raise _Gone from None
        finally:
            os.close(fd)
        # comm may hold spaces and parentheses: it ends at the last ')'.
        end = data.rfind(b")")
        if end < 0:
            raise _Gone
        comm = data[data.find(b"(") + 1 : end].decode(errors="replace")
        f = data[end + 2 :].split()
        # Fields counted from 'state' (field 3 of proc(5)).
        return _Stat(
            ppid=int(f[1]),
            start=float(f[19]),
            comm=comm,
            zombie=f[0] in (b"Z", b"X"),
            cpu_s=(int(f[11]) + int(f[12])) / self._ticks,
            # The kernel's fast RSS counter: per-CPU deltas not yet folded in make it lag
            # statm's (psutil's) by at most a small batch of pages per CPU, which a
            # dashboard can bear; a second file per process per tick the budget could not.
            rss=int(f[21]) * self._page,
            threads=int(f[17]),
            uid=uid,
        )

    def cmdline(self, pid: int) -> list[str]:
        try:
            fd = os.open(f"/proc/{pid}/cmdline", os.O_RDONLY)
        except OSError:
            return []
        try:
            data = os.read(fd, _CMDLINE_BYTES)
        except OSError:
            return []
        finally:
            os.close(fd)
        return data.rstrip(b"\0").decode(errors="replace").split("\0") if data else []

    def environ(self, pid: int) -> bytes:
        # Another user's environ is mode 0400: PermissionError, so never the box's.
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f.read()
        except OSError:
            return b""

    def forget(self, pid: int) -> None:
        pass


class _Psutil:
    """The same reads through psutil, for systems without a Linux /proc."""

    def __init__(self) -> None:
        self._handles: dict[int, psutil.Process] = {}

    def _handle(self, pid: int) -> psutil.Process:
        handle = self._handles.get(pid)
        if handle is None:
            try:
                handle = self._handles[pid] = psutil.Process(pid)
            except psutil.Error:
                raise _Gone from None
        return handle

    def pids(self) -> set[int]:
        return set(psutil.pids())

    def stat(self, pid: int) -> _Stat:
        handle = self._handle(pid)
        try:
            with handle.oneshot():
                times = handle.cpu_times()
                return _Stat(
                    ppid=handle.ppid(),
                    start=handle.create_time(),
                    comm=handle.name(),
                    zombie=handle.status() == psutil.STATUS_ZOMBIE,
                    cpu_s=times.user + times.system,
                    rss=handle.memory_info().rss,
                    threads=handle.num_threads(),
                    uid=handle.uids().real,
                )
        except psutil.Error:
            raise _Gone from None

    def cmdline(self, pid: int) -> list[str]:
        try:
            return list(self._handle(pid).cmdline())
        except (psutil.Error, _Gone):
            return []

    def environ(self, pid: int) -> bytes:
        try:
            env = self._handle(pid).environ()
        except (psutil.Error, _Gone):
            return b""
        return b"".join(f"{k}={v}\0".encode(errors="replace") for k, v in env.items())

    def forget(self, pid: int) -> None:
        self._handles.pop(pid, None)


@dataclass(slots=True)
class _Known:
    """A box process as of the previous read."""

    start: float
    comm: str
    cpu_s: float
    t: float
    args: list[str]
    args_t: float


class HostSampler:
    def __init__(
        self, *, root_pid: int, box_marker: tuple[str, str] | None, all_processes: bool
    ) -> None:
        self._root = root_pid
        # Matched against b"\0" + environ: a whole variable, so box "a" is not box "ab".
        self._needle = (
            None if box_marker is None else f"\0{box_marker[0]}={box_marker[1]}\0".encode()
        )
        self._all = all_processes
        self._reader: _Procfs | _Psutil = _Procfs() if _PROCFS else _Psutil()
        self._box: dict[int, _Known] = {}
        self._others: set[int] = set()  # judged not the box's: never read again
        self._users: dict[int, str] = {}
        # psutil.cpu_percent keeps its previous reading in module state, shared with any
        # other caller in the process; a sampler keeps its own. Taking it here makes the
        # first read's figures cover the time since construction.
        self._cpu_prev = [_busy_total(t) for t in psutil.cpu_times(percpu=True)]
        self._io_prev: tuple[float, tuple[int, int] | None, tuple[int, int] | None] | None = None

    def read(self) -> tuple[HostSample, list[BoxProcess]]:
        now = time.monotonic()
        return self._host(now), self._processes(now)

    # --- host-wide figures

    def _host(self, now: float) -> HostSample:
        cpu_now = [_busy_total(t) for t in psutil.cpu_times(percpu=True)]
        cpu = [_percent(prev, cur) for prev, cur in zip(self._cpu_prev, cpu_now, strict=False)]
        cpu += [0.0] * (len(cpu_now) - len(cpu))  # a CPU came online: no baseline yet
        self._cpu_prev = cpu_now
        try:
            load1: float | None = os.getloadavg()[0]
        except (OSError, AttributeError):
            load1 = None
        mem, swap = psutil.virtual_memory(), psutil.swap_memory()
        disk, net = _disk_bytes(), _net_bytes()
        prev, self._io_prev = self._io_prev, (now, disk, net)
        rates: list[float | None] = [None] * 4
        if prev is not None and now > prev[0]:
            dt = now - prev[0]
            for i, (old, new) in enumerate(((prev[1], disk), (prev[2], net))):
                if old is not None and new is not None:
                    # A counter can fall when a disk or NIC goes away: no negative rates.
                    rates[2 * i] = max(0, new[0] - old[0]) / dt
                    rates[2 * i + 1] = max(0, new[1] - old[1]) / dt
        return {
            "cpu": cpu,
            "load1": load1,
            "mem_used": mem.used,
            "mem_total": mem.total,
            "swap_used": swap.used,
            "disk_read_bps": rates[0],
            "disk_write_bps": rates[1],
            "net_rx_bps": rates[2],
            "net_tx_bps": rates[3],
        }

    # --- the box's processes

    def _processes(self, now: float) -> list[BoxProcess]:
        reader = self._reader
        listed = reader.pids()
        for pid in self._box.keys() - listed:
            del self._box[pid]
            reader.forget(pid)
        self._others &= listed
        fresh: dict[int, _Stat] = {}
        for pid in listed - self._box.keys() - self._others:
            try:
                fresh[pid] = reader.stat(pid)
            except _Gone:
                # Vanished (it leaves the listing, and _others, next tick) or unreadable
                # (psutil's AccessDenied elsewhere): either way not worth another read.
                self._others.add(pid)
                reader.forget(pid)
        out: list[BoxProcess] = []
        for pid, known in list(self._box.items()):
            try:
                st = reader.stat(pid)
            except _Gone:
                del self._box[pid]
                reader.forget(pid)
                continue
            if st.start != known.start:  # the PID was reused: judge the newcomer
                del self._box[pid]
                fresh[pid] = st
            elif st.zombie:  # it will never run again, and can't be reused until reaped
                del self._box[pid]
                self._others.add(pid)
            else:
                cpu = None
                if now > known.t:
                    cpu = max(0.0, st.cpu_s - known.cpu_s) / (now - known.t) * 100.0
                if st.comm != known.comm or now - known.args_t >= CMDLINE_TTL:
                    known.args, known.args_t = reader.cmdline(pid), now
                known.comm, known.cpu_s, known.t = st.comm, st.cpu_s, now
                out.append(self._entry(pid, st, known.args, cpu))
        for pid in self._judge(fresh):
            st = fresh[pid]
            args = reader.cmdline(pid)
            self._box[pid] = _Known(st.start, st.comm, st.cpu_s, now, args, now)
            out.append(self._entry(pid, st, args, None))
        out.sort(key=lambda p: p["pid"])
        return out

    def _judge(self, fresh: dict[int, _Stat]) -> list[int]:
        """The box's processes among those seen for the first time; the rest are
        remembered as not the box's."""
        if self._all:
            mine = {pid for pid, st in fresh.items() if not st.zombie}
        else:
            children: dict[int, list[int]] = {}
            for pid, st in fresh.items():
                children.setdefault(st.ppid, []).append(pid)
            mine = set()
            roots = [p for p, st in fresh.items() if p == self._root or st.ppid in self._box]
            _descend(roots, children, mine)
            needle = self._needle
            if needle is not None:
                # Parents start before their children: judging in start order lets a
                # marked parent claim its subtree before the children's environ is read.
                for pid in sorted(fresh, key=lambda p: (fresh[p].start, p)):
                    if pid not in mine and needle in b"\0" + self._reader.environ(pid):
                        _descend([pid], children, mine)
            mine = {pid for pid in mine if not fresh[pid].zombie}
        strangers = fresh.keys() - mine
        self._others |= strangers
        for pid in strangers:
            self._reader.forget(pid)
        return sorted(mine)

    def _entry(self, pid: int, st: _Stat, args: list[str], cpu: float | None) -> BoxProcess:
        name = st.comm
        if len(name) >= _COMM_MAX and args:
            # As psutil does: the full name from argv[0] when the kernel cut comm short.
            full = os.path.basename(args[0])
            if full.startswith(name):
                name = full
        return {
            "pid": pid,
            "ppid": st.ppid,
            "name": name,
            "cmdline": " ".join(args)[:CMDLINE_CHARS],
            "user": None if st.uid is None else self._user(st.uid),
            "cpu": cpu,
            "rss": st.rss,
            "threads": st.threads,
        }

    def _user(self, uid: int) -> str:
        # getpwuid may read /etc/passwd (or ask NSS) every call; users rarely change.
        name = self._users.get(uid)
        if name is None:
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                name = str(uid)  # as psutil: a container user without a passwd entry
            self._users[uid] = name
        return name


def _descend(roots: list[int], children: dict[int, list[int]], mine: set[int]) -> None:
    stack = [p for p in roots if p not in mine]
    while stack:
        pid = stack.pop()
        if pid not in mine:
            mine.add(pid)
            stack.extend(children.get(pid, ()))


def _busy_total(t: Any) -> tuple[float, float]:
    # As psutil.cpu_percent: Linux counts guest time inside user and nice as well.
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def _percent(prev: tuple[float, float], cur: tuple[float, float]) -> float:
    busy, total = cur[0] - prev[0], cur[1] - prev[1]
    if busy <= 0 or total <= 0:
        return 0.0
    return min(100.0, busy / total * 100.0)


def _disk_bytes() -> tuple[int, int] | None:
    try:
        io = psutil.disk_io_counters()
    except (OSError, NotImplementedError):  # no /proc/diskstats nor /sys/block
        return None
    return None if io is None else (io.read_bytes, io.write_bytes)


def _net_bytes() -> tuple[int, int] | None:
    try:
        nics = psutil.net_io_counters(pernic=True)
    except OSError:
        return None
    # Loopback is not the network: a local box's port-forward would count twice in it.
    real = [io for name, io in nics.items() if name != "lo"]
    if not real:
        return None
    return sum(io.bytes_recv for io in real), sum(io.bytes_sent for io in real)
