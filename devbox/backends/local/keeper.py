"""The keeper of a local box: the first process of the box and the last to go.

A box's GPUs must stay taken while any process of the box can still use them, not only
while its agent lives: a screen or tmux server daemonises away from the agent, and a
`nohup` or double-forked job outlives the shell that started it, both with
CUDA_VISIBLE_DEVICES set. So the launcher starts this keeper instead of the agent:

- it is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so every process of the box,
  however it detaches (setsid, double fork, a multiplexer's server), is reparented to it
  rather than to init: "the box's processes" is exactly the keeper's descendants;
- it spawns the agent, which hands it the bound GPU lock sockets (SCM_RIGHTS over an
  inherited socketpair) before it reports ready, so the names (devbox.gpulocks) stay bound
  while the keeper lives, and the keeper lives until it has no child left (waitpid
  ECHILD), that is until no process of the box is left;
- once the agent is gone it listens on the names itself, so a refusal names a live
  process (SO_PEERCRED tells the pid that listened last) and holder queries are answered;
- SIGTERM (`devbox down`, a release) ends the box as deleting a pod would: the agent
  first (its probed processes save, then it ends the sessions, so attached clients see
  them end), then every descendant, SIGTERM and after a grace SIGKILL, until none is
  left; then it exits. The agent gets AGENT_GRACE plus the limit of the release file the
  backend wrote (the agent's --release-file; devbox.saves), as a pod gets its grace.

It lives as long as the box, so it runs in an isolated interpreter without site-packages
(`python -I -S`) and imports only the standard library: no devbox package. It is imported
from its folder rather than run as a script by path (RUN, what the launcher passes to -c):
a script is compiled at every start, and the compiler's leftovers stayed in the keeper's
memory for the box's life (1.1 MiB of its 5, benchmarks/bench_idle.py); an import uses
the cached bytecode. The local backend imports it as a module for `descendants`.

usage: python -I -S -c RUN LOCK_FILE READY_FD AGENT_ARGV...  (or keeper.py by path; the
agent gets --keeper-fd FD appended)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import sys
import time

# The -c program that runs the keeper from its compiled bytecode (see above).
RUN = (
    f"import sys; sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}]; "
    "import keeper; sys.exit(keeper.main(sys.argv[1:]))"
)
PR_SET_CHILD_SUBREAPER = 36
AGENT_GRACE = 10.0  # seconds the agent gets to end the sessions itself
MAX_SAVE = 3600.0  # the most a release file may add to it (devbox.saves.MAX_LIMIT)
TERM_GRACE = 5.0  # seconds the box's other processes get between SIGTERM and SIGKILL
KILL_EVERY = 0.1  # a process forked between two SIGKILL sweeps goes in the next one
MAX_FDS = 64  # lock sockets one agent may hand over (a GPU each)


def descendants(root: int) -> set[int]:
    """Every live process below `root`, from /proc's parent links (never by name)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        parent = _parent(int(entry.name))
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so cut at the last ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def signal_all(root: int, signum: int) -> int:
    """Send `signum` to every descendant of `root`; how many were signalled.

    Through a pidfd, checked after opening, so a pid that ended and was reused by a
    stranger between the walk and the signal is never hit."""
    tree = descendants(root)
    sent = 0
    for pid in tree:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # already gone
        try:
            if _parent(pid) in tree | {root}:
                signal.pidfd_send_signal(fd, signum)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return sent


def release_limit(agent_argv: list[str]) -> float:
    """Seconds the release gives the box's processes to save: the "limit" of the file the
    agent's --release-file names, written before the SIGTERM; 0 without one."""
    import json  # only as the box ends: not in the keeper's memory all its life

    try:
        path = agent_argv[agent_argv.index("--release-file") + 1]
        with open(path, "rb") as f:
            limit = float(json.loads(f.read(4096))["limit"])
    except (ValueError, IndexError, KeyError, TypeError, OSError):
        return 0.0
    return min(limit, MAX_SAVE) if limit > 0 else 0.0  # nan: 0


class Keeper:
    def __init__(
        self, channel: socket.socket, wake: int, agent_argv: list[str] | None = None
    ) -> None:
        self.agent: int | None = None
        self.agent_status = 0
        self.channel: socket.socket | None = channel
        self.wake = wake
        self.locks: list[socket.socket] = []
        self.ending = False
        self._phase = ""
        self._deadline = 0.0
        self._agent_argv = agent_argv or []

    def run(self) -> int:
        while True:
            if not self._reap():
                return self.agent_status  # no process of the box is left: the names drop
            timeout = self._end_step() if self.ending else None
            watched: list[int | socket.socket] = [self.wake, *self.locks]
            if self.channel is not None:
                watched.append(self.channel)
            with contextlib.suppress(InterruptedError):
                readable, _, _ = select.select(watched, [], [], timeout)
                for item in readable:
                    self._readable(item)

    def _reap(self) -> bool:
        """Collect ended children; False once there is none left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.agent:
                self.agent = None
                self.agent_status = os.waitstatus_to_exitcode(status)
                for sock in self.locks:
                    sock.listen(128)  # the holder a refusal names is now this process

    def _readable(self, item: int | socket.socket) -> None:
        if item == self.wake:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake, 512)
        elif item is self.channel:
            self._receive()
        elif isinstance(item, socket.socket):
            with contextlib.suppress(OSError):  # a holder query: accept and drop it
                item.accept()[0].close()

    def _receive(self) -> None:
        assert self.channel is not None
        try:
            msg, ancdata, _flags, _addr = self.channel.recvmsg(
                16, socket.CMSG_LEN(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
        except BlockingIOError:
            return
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % 4
                for fd in memoryview(data)[:usable].cast("i"):
                    sock = socket.socket(fileno=fd)
                    sock.setblocking(False)  # accept() must never wait
                    if self.agent is None:  # it sent them and died before they were read
                        sock.listen(128)
                    self.locks.append(sock)
        if not msg and not ancdata:  # the agent closed its end: it has said all it will
            self.channel.close()
            self.channel = None

    def _end_step(self) -> float:
        """One step of ending the box; the seconds until the next."""
        now = time.monotonic()
        if not self._phase:
            grace = AGENT_GRACE + release_limit(self._agent_argv)
            self._phase, self._deadline = "agent", now + grace
            if self.agent is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.agent, signal.SIGTERM)
        if self._phase == "agent" and (self.agent is None or now >= self._deadline):
            self._phase, self._deadline = "term", now + TERM_GRACE
            left = signal_all(os.getpid(), signal.SIGTERM)
            if left:
                _say(f"ending the box's {left} remaining process(es)")
        if self._phase == "term" and now >= self._deadline:
            self._phase = "kill"
        if self._phase == "kill":
            signal_all(os.getpid(), signal.SIGKILL)
            return KILL_EVERY
        return max(0.0, min(self._deadline - now, KILL_EVERY * 5))


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"devbox keeper {os.getpid()}: {text}\n")
        sys.stderr.flush()


def _hold_lock(path: str) -> int:
    """Held for the keeper's life: a free lock means no process of the box is left."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second keeper of one box fails here
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _become_subreaper() -> None:
    import ctypes  # only the keeper itself: the CLI imports this module for descendants()

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        _say("usage: keeper.py LOCK_FILE READY_FD AGENT_ARGV... (the local backend runs it)")
        return 2
    lock_path, ready_fd, *agent_argv = argv
    _hold_lock(lock_path)
    _become_subreaper()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    keeper = Keeper(ours, wake_r, agent_argv)

    def end(_signum: int, _frame: object) -> None:
        keeper.ending = True

    # Handlers before the agent exists: a SIGTERM from here on ends what was started;
    # one before it kills this process, which has started nothing yet.
    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # only to wake select()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no terminal: a stray hangup is not an end
    # The launcher holds SIGINT back while it forks this process, and a forked child
    # inherits that mask: let everything in (the agent inherits this mask too).
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.set_inheritable(theirs.fileno(), True)
    keeper.agent = os.posix_spawn(
        agent_argv[0],
        [*agent_argv, "--keeper-fd", str(theirs.fileno())],
        os.environ,
        setsigdef=(signal.SIGHUP,),
    )
    theirs.close()
    os.close(int(ready_fd))  # the launcher's EOF must mean the agent closed it
    return keeper.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
