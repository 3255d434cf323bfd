"""The terminals of a box, and a line written to each of them, as wall(1) writes to logins.

The autoscaler's warning must reach its user wherever they work in the box, not only in
its screen/tmux session: an editor's integrated terminal (VS Code's are PTYs that its server
opens in the box), `ssh -t NAME.devbox htop`, a shell of a box without a multiplexer. Those
are the PTYs that the box's processes hold as their controlling terminal or stdin, stdout
or stderr. Terminals held by a multiplexer process or any process below one (its clients,
its server, the shells in its windows) are left out: the multiplexer shows the message
itself, and raw text written to its client's terminal would corrupt the screen it draws.

Safety, as wall's: a terminal is opened O_WRONLY|O_NOCTTY|O_NONBLOCK (it never becomes our
controlling terminal, and a stalled reader never blocks us), only through a /dev/pts entry
that is a character device (never a symlink), and written only when fstat after the open
says it is the device looked for and belongs to the box's user.

The standard library only: the agent imports it, and so does every autoscaler pass.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass

PTS = "/dev/pts"
MULTIPLEXERS = ("screen", "tmux")
_OPEN = os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class _Proc:
    ppid: int
    tty: int  # the controlling terminal's device number; 0: none
    comm: str


class Processes:
    """One look at /proc: every visible process's parent, terminal and name."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self.table: dict[int, _Proc] = {}
        self.children: dict[int, list[int]] = {}
        try:
            entries = list(os.scandir(proc))
        except OSError:
            return  # no procfs: no terminals to find
        for entry in entries:
            if entry.name.isdigit() and (found := self._read(entry.name)) is not None:
                self.table[int(entry.name)] = found
        for pid, p in self.table.items():
            self.children.setdefault(p.ppid, []).append(pid)

    def _read(self, pid: str) -> _Proc | None:
        try:
            with open(f"{self.proc}/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            return None  # ended meanwhile
        # pid (comm) state ppid pgrp session tty_nr ...: comm may hold spaces and ")".
        cut = raw.rfind(b")")
        fields = raw[cut + 2 :].split()
        if len(fields) < 5:
            return None
        comm = raw[raw.find(b"(") + 1 : cut].decode(errors="replace")
        return _Proc(ppid=int(fields[1]), tty=_device(int(fields[4])), comm=comm)

    def every(self) -> set[int]:
        return set(self.table)

    def below(self, roots: Iterable[int]) -> set[int]:
        """`roots` (those alive) and every process under them, by parent links."""
        found = {r for r in roots if r in self.table}
        todo = list(found)
        while todo:
            for child in self.children.get(todo.pop(), ()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    def marked(self, marker: str) -> set[int]:
        """Processes whose environment at start held `marker` ("NAME=value"); only those
        this process may read (its own user's, or all as root)."""
        needle = f"\0{marker}\0".encode()
        out: set[int] = set()
        for pid in self.table:
            try:
                with open(f"{self.proc}/{pid}/environ", "rb") as f:
                    env = b"\0" + f.read()
            except OSError:
                continue
            if needle in env:
                out.add(pid)
        return out

    def terminals(self, pid: int) -> set[int]:
        """Device numbers of the terminal-like files the process holds as its controlling
        terminal or as fds 0-2 (character devices; /dev/pts tells which are terminals)."""
        p = self.table.get(pid)
        found = {p.tty} if p is not None and p.tty else set()
        for fd in (0, 1, 2):
            try:
                st = os.stat(f"{self.proc}/{pid}/fd/{fd}")
            except OSError:
                continue  # closed, or not ours to look at
            if stat.S_ISCHR(st.st_mode):
                found.add(st.st_rdev)
        return found

    def is_program(self, pid: int, programs: Collection[str]) -> bool:
        """Whether the process runs one of `programs` (resolved paths). Its executable
        when readable; else (another user's, or a set-id program's, which /proc hides)
        its name, which its owner could fake only to miss a warning of their own."""
        try:
            exe = os.readlink(f"{self.proc}/{pid}/exe").removesuffix(" (deleted)")
        except OSError:
            p = self.table.get(pid)
            return p is not None and p.comm in {os.path.basename(x) for x in programs}
        return exe in programs


def _device(tty_nr: int) -> int:
    """/proc's tty_nr (major in bits 8-15, minor in 0-7 and 20-31) as a dev_t."""
    if not tty_nr:
        return 0
    major = (tty_nr >> 8) & 0xFFF
    minor = (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    return os.makedev(major, minor)


def multiplexer_programs(*known: str) -> frozenset[str]:
    """The resolved paths of screen and tmux on PATH, and of `known` (the box's own)."""
    paths = [p for p in (*known, *(shutil.which(m) for m in MULTIPLEXERS)) if p]
    return frozenset(os.path.realpath(p) for p in paths)


def _pts() -> dict[int, str]:
    """Device number -> path of every pseudo-terminal in /dev/pts (not ptmx, no links)."""
    out: dict[int, str] = {}
    try:
        entries = list(os.scandir(PTS))
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out[st.st_rdev] = entry.path
    return out


def box_terminals(
    table: Processes, box: Collection[int], *, multiplexers: Collection[str]
) -> dict[int, str]:
    """The pseudo-terminals (device -> path) that processes of `box` hold, less every one
    that a multiplexer process, or a process below one, holds."""
    members = set(box)
    inside = table.below(pid for pid in members if table.is_program(pid, multiplexers))
    held = set().union(*(table.terminals(pid) for pid in members - inside))
    skipped = set().union(*(table.terminals(pid) for pid in inside))
    pts = _pts()
    return {dev: pts[dev] for dev in held - skipped if dev in pts}


def write_line(path: str, device: int, text: str, *, uid: int) -> bool:
    """`text` on a line of its own on the terminal at `path`, if it is still `device` and
    `uid`'s; never blocks (a terminal nobody reads loses the line)."""
    line = "".join(c if c.isprintable() else "?" for c in text)
    data = b"\r\n" + line.encode(errors="replace") + b"\r\n"
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return False  # gone, or not ours
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != device or st.st_uid != uid:
            return False
        os.write(fd, data)
        return True
    except OSError:  # a full buffer (EAGAIN), a hung-up terminal (EIO)
        return False
    finally:
        os.close(fd)


def tell(
    text: str,
    *,
    table: Processes,
    box: Collection[int],
    multiplexers: Collection[str],
    uid: int | None = None,
) -> int:
    """Write `text` to every terminal of `box` outside its multiplexer (see the module);
    how many got it. `uid`: whose terminals may be written (default: this process's)."""
    owner = os.geteuid() if uid is None else uid
    found = box_terminals(table, box, multiplexers=multiplexers)
    return sum(write_line(path, dev, text, uid=owner) for dev, path in sorted(found.items()))
