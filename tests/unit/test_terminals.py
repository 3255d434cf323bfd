"""devbox.terminals against real PTYs and processes: which terminals of a set of processes
get a line (none a multiplexer holds), and the wall(1)-like care taken in writing it."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from devbox import terminals
from tests.waiting import wait_until


def _read(master: int, want: bytes, timeout: float = 5.0) -> bytes:
    got = b""
    while want not in got:
        ready, _, _ = select.select([master], [], [], timeout)
        assert ready, f"{want!r} never came; got {got!r}"
        got += os.read(master, 4096)
    return got


@contextmanager
def _on_new_pty(argv: list[str]) -> Iterator[tuple[int, int]]:
    """argv as the leader of a new session whose controlling terminal is a fresh PTY: (its
    pid, the master). Spawned, not pty.fork(): by now the test process may run threads (JAX,
    torch), and a fork of a threaded process can deadlock in the child before its exec."""
    master, slave = pty.openpty()
    path = os.ttyname(slave)
    os.close(slave)
    # The new session's leader, sh, opens the terminal (so it becomes its controlling one)
    # and execs argv in place: the pid stays.
    child = subprocess.Popen(
        ["sh", "-c", 'exec "$@" <>"$0" >&0 2>&0', path, *argv], start_new_session=True
    )
    try:
        yield child.pid, master
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the session's leader leads its group too
        child.wait()
        os.close(master)


def _table_with(check: Callable[[terminals.Processes], bool], what: str) -> terminals.Processes:
    def look() -> terminals.Processes | None:
        table = terminals.Processes()
        return table if check(table) else None

    found: terminals.Processes = wait_until(look, 5, what)
    return found


@pytest.fixture
def on_pty() -> Iterator[tuple[int, int]]:
    """A `sleep` on the slave side of a fresh PTY: (its pid, the master)."""
    with _on_new_pty(["sleep", "60"]) as (pid, master):
        _table_with(
            lambda t: bool(terminals.box_terminals(t, {pid}, multiplexers=frozenset())),
            "the child on its terminal",
        )
        yield pid, master


def test_a_process_terminal_gets_the_line_once_and_control_characters_never(
    on_pty: tuple[int, int],
) -> None:
    pid, master = on_pty
    table = terminals.Processes()
    told = terminals.tell(
        "warned \x1b[2J\x07 box", table=table, box={pid}, multiplexers=frozenset()
    )
    assert told == 1
    got = _read(master, b"box")
    assert b"warned ?[2J? box" in got and b"\x1b" not in got and b"\x07" not in got


def test_terminals_a_multiplexer_or_a_process_below_one_holds_are_skipped(
    tmp_path: Path,
) -> None:
    """A stand-in multiplexer: a copy of sh, so its own terminal and its child's are in it."""
    mux = tmp_path / "fakemux"
    shutil.copy(shutil.which("sh") or "/bin/sh", mux)
    with _on_new_pty([str(mux), "-c", "sleep 60; :"]) as (pid, _master):  # sleep: its child
        table = _table_with(lambda t: len(t.below([pid])) == 2, "the stand-in and its child")
        box = table.below([pid])
        programs = terminals.multiplexer_programs(str(mux))
        assert terminals.box_terminals(table, box, multiplexers=programs) == {}
        assert len(terminals.box_terminals(table, box, multiplexers=frozenset())) == 1


def test_a_terminal_is_written_only_as_itself_and_its_owners(
    on_pty: tuple[int, int], tmp_path: Path
) -> None:
    pid, master = on_pty
    table = terminals.Processes()
    ((device, path),) = terminals.box_terminals(table, {pid}, multiplexers=frozenset()).items()
    me = os.geteuid()
    link = tmp_path / "planted"
    link.symlink_to(path)
    assert not terminals.write_line(str(link), device, "x", uid=me)  # never through a link
    assert not terminals.write_line(path, device, "x", uid=me + 1)  # another user's
    assert not terminals.write_line(path, device + 1, "x", uid=me)  # not the one looked for
    assert not terminals.write_line(str(tmp_path / "gone"), device, "x", uid=me)
    assert terminals.write_line(path, device, "mine", uid=me)
    assert _read(master, b"mine").count(b"x") == 0


def test_a_terminal_nobody_reads_never_blocks_the_writer(on_pty: tuple[int, int]) -> None:
    pid, _master = on_pty  # nothing reads the master: its buffer fills
    table = terminals.Processes()
    ((device, path),) = terminals.box_terminals(table, {pid}, multiplexers=frozenset()).items()
    line = "y" * 1000
    results = [terminals.write_line(path, device, line, uid=os.geteuid()) for _ in range(2000)]
    assert results[0] and not results[-1]


def test_processes_below_a_root_and_marked_ones() -> None:
    marker = f"DEVBOX_BOX=t{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "DEVBOX_BOX": marker.split("=")[1]}
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], env=env, start_new_session=True)
    try:
        table = _table_with(lambda t: len(t.below([child.pid])) == 2, "the shell and its sleep")
        below = table.below([child.pid])
        assert child.pid in below
        assert table.marked(marker) == below
        assert table.below([2**22 + 1]) == set()  # no such process
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
