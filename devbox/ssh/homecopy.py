"""Copy a home from one box to another through this process, over each box's SFTP server
(`devbox move`), sending only what changed.

devbox.ssh.homeplan decides what is sent and what is left alone (nothing on the destination
is deleted, nothing newer there overwritten, no link followed); devbox.ssh.homesftp writes
each file or link safely. This module lists both sides, one READDIR per folder, both sides
at once and PARALLEL folders at a time, and carries the plan out:

- the temporary files an interrupted copy left are removed first;
- folders are made, parents first, 0700 while their contents arrive (so that a read-only
  one can be filled), and given the source's mode and mtime after;
- files and links go PARALLEL at a time;
- a folder that was there keeps its mtime: where the copy added to it, the time it had is
  set back, so that the copy itself leaves no trace of when it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from devbox import units
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import session
from devbox.ssh.homeplan import Entry, Kind, Plan, below, excluded, excludes, plan
from devbox.ssh.homesftp import (
    PARALLEL,
    Refused,
    Side,
    all_of,
    each,
    guard,
    send_file,
    send_link,
    stamp,
)

PROGRESS_SECONDS = 2.0  # at most one progress line this often


@dataclass(frozen=True)
class Copied:
    sent: list[str]  # relative paths of files (and links) written on the destination
    sent_bytes: int
    kept_newer: list[str]  # the destination's copy is newer than the source's: left alone
    skipped: list[str]  # special files, unreadable files, conflicts: "path (why)"
    folders: int  # folders made


class _Progress:
    """A line at most every PROGRESS_SECONDS, made only when it is said."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.last = time.monotonic()

    def tick(self, line: Callable[[], str]) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self.say(line())


class _AllListed(Exception):
    """Ends the listing's workers."""


async def _listdir(side: Side, rel: str, listing: dict[str, Entry]) -> dict[str, Entry] | None:
    """The folder's entries; None where the box refuses, and the folder is marked so in
    `listing`. A refused root ends the copy."""
    try:
        return await side.listdir(rel)
    except Refused as exc:
        if not rel:
            raise
        listing[rel] = Entry(Kind.FOLDER, error=exc.why)
        return None


async def _nothing() -> dict[str, Entry]:
    return {}


async def _walk(
    src: Side, dst: Side, exclude: frozenset[str], progress: _Progress
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """Both listings. The destination's is read only in folders that are folders on both
    sides: the plan needs nothing else of it."""
    here: dict[str, Entry] = {}
    there: dict[str, Entry] = {}
    queue: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
    queue.put_nowait(("", True))

    async def visit(rel: str, on_dst: bool) -> None:
        inside, found = await asyncio.gather(
            _listdir(src, rel, here), _listdir(dst, rel, there) if on_dst else _nothing()
        )
        if inside is None or found is None:
            return  # the plan skips the folder, saying why
        for name, entry in found.items():
            if not excluded(child := posixpath.join(rel, name), exclude):
                there[child] = entry
        for name, entry in inside.items():
            if excluded(child := posixpath.join(rel, name), exclude):
                continue
            here[child] = entry
            theirs = found.get(name)
            # Under a folder the destination has something else for, nothing is copied.
            if entry.kind is Kind.FOLDER and (theirs is None or theirs.kind is Kind.FOLDER):
                queue.put_nowait((child, theirs is not None))
        progress.tick(lambda: f"listed {len(here)} entries on box {src.box.name}")

    async def worker() -> None:
        while True:
            rel, on_dst = await queue.get()
            try:
                await visit(rel, on_dst)
            finally:
                queue.task_done()

    async def all_listed() -> None:
        await queue.join()
        raise _AllListed

    with contextlib.suppress(_AllListed):
        await all_of([all_listed(), *(worker() for _ in range(PARALLEL))])
    return here, there


async def _roots(src: Side, dst: Side) -> tuple[Entry, Entry | None, int]:
    """The roots as they are: the source's (a folder), the destination's (None where this
    made it, with its missing parents), and the folders made. The roots are followed as
    `cd` would follow them (the caller named them); nothing below them is."""
    mine = await src.stat("")
    if mine is None or mine.kind is not Kind.FOLDER:
        raise DevboxError(f"box {src.box.name} has no folder {src.path('')} to copy")
    theirs = await dst.stat("")
    if theirs is not None:
        if theirs.kind is not Kind.FOLDER:
            raise DevboxError(f"box {dst.box.name}: {dst.path('')} is not a folder")
        return mine, theirs, 0
    made = 0
    parts = dst.root.split("/")
    for path in ("/".join(parts[: i + 1]) for i in range(len(parts)) if parts[i]):
        with guard(dst.box, path, "make the folder"):
            if not await dst.sftp.isdir(path):
                await dst.sftp.mkdir(path, asyncssh.SFTPAttrs(permissions=0o700))
                made += 1
    return mine, None, made


class _Copy:
    """Carrying out one plan, and what it did."""

    def __init__(
        self, src: Side, dst: Side, listings: tuple[dict[str, Entry], dict[str, Entry]], todo: Plan
    ) -> None:
        self.src, self.dst, self.todo = src, dst, todo
        self.here, self.there = listings
        self.sent: list[str] = []
        self.sent_bytes = 0
        self.skipped = list(todo.skipped)
        self.failed: set[str] = set()  # folders the destination would not make
        self.touched: set[str] = set()  # folders that were there and that the copy changed
        self.total = sum(self.here[rel].size for rel in todo.files)

    def summary(self) -> str:
        todo = self.todo
        return (
            f"listed {len(self.here)} entries on box {self.src.box.name}: sending "
            f"{len(todo.files)} files ({units.size(self.total)}) and {len(todo.links)} links, "
            f"making {len(todo.folders)} folders; {todo.unchanged} unchanged"
        )

    def status(self) -> str:
        return (
            f"sent {len(self.sent)} of {len(self.todo.files) + len(self.todo.links)} files, "
            f"{units.size(self.sent_bytes)} of {units.size(self.total)}"
        )

    async def clean(self, rel: str) -> None:
        with contextlib.suppress(Refused), self.dst.guard(rel, "remove"):
            await self.dst.sftp.remove(self.dst.path(rel))
            self.touched.add(posixpath.dirname(rel))

    async def mkdir(self, rel: str) -> None:
        if below(rel, self.failed):
            self.failed.add(rel)  # its parent's line says so
            return
        try:
            with self.dst.guard(rel, "make the folder"):
                await self.dst.sftp.mkdir(self.dst.path(rel), asyncssh.SFTPAttrs(permissions=0o700))
        except Refused as exc:
            self.failed.add(rel)
            self.skipped.append(f"{rel} ({exc.why})")
        self.touched.add(posixpath.dirname(rel))

    async def send(self, rel: str, progress: _Progress) -> None:
        if below(rel, self.failed):
            return  # the folder's own line says so

        mine = 0

        def sent(nbytes: int) -> None:
            nonlocal mine
            mine += nbytes
            self.sent_bytes += nbytes
            progress.tick(self.status)

        entry = self.here[rel]
        try:
            if entry.kind is Kind.LINK:
                await send_link(self.dst, rel, entry)
            else:
                await send_file(self.src, self.dst, rel, entry, sent)
        except Refused as exc:
            self.sent_bytes -= mine  # written to a temporary file, and discarded
            self.skipped.append(f"{rel} ({exc.why})")
            return
        self.sent.append(rel)
        self.touched.add(posixpath.dirname(rel))
        sent(0)

    def stamps(self, roots: tuple[Entry, Entry | None]) -> dict[str, asyncssh.SFTPAttrs]:
        """The folders' last attributes: those made get the source's mode and time, those
        that were there and were written into get their own time back. (Setting attributes
        changes no folder's time, so the order does not matter.)"""
        mine, theirs = roots
        made = {rel: self.here[rel] for rel in self.todo.folders if rel not in self.failed}
        if theirs is None:
            made[""] = mine
        out = {rel: stamp(entry) for rel, entry in made.items()}
        for rel in self.touched - out.keys():
            entry = theirs if not rel else self.there.get(rel)
            if entry is not None and entry.kind is Kind.FOLDER:
                out[rel] = stamp(entry, mode=False)
        return out


async def _copy(
    src: Side, dst: Side, exclude: frozenset[str], say: Callable[[str], None]
) -> Copied:
    progress = _Progress(say)
    mine, theirs, made = await _roots(src, dst)
    listings = await _walk(src, dst, exclude, progress)
    todo = plan(*listings)
    run = _Copy(src, dst, listings, todo)
    say(run.summary())
    await each(todo.leftovers, run.clean)
    depths = sorted({rel.count("/") for rel in todo.folders})
    for depth in depths:  # parents first, each depth at once
        await each((f for f in todo.folders if f.count("/") == depth), run.mkdir)
    await each([*todo.links, *todo.files], lambda rel: run.send(rel, progress))
    stamps = run.stamps((mine, theirs))
    await each(stamps, lambda rel: dst.setstat(rel, stamps[rel]))
    return Copied(
        sent=sorted(run.sent),
        sent_bytes=run.sent_bytes,
        kept_newer=todo.kept_newer,
        skipped=sorted(run.skipped),
        folders=made + len(set(todo.folders) - run.failed),
    )


async def _sftp(box: Box, conn: asyncssh.SSHClientConnection) -> asyncssh.SFTPClient:
    with guard(box, "", "start SFTP on it"):
        # surrogateescape: a name that is not UTF-8 travels as the same bytes.
        sftp = await conn.start_sftp_client(path_errors="surrogateescape")
    return sftp


async def _copy_home(
    src: Box,
    src_sock: socket.socket,
    dst: Box,
    dst_sock: socket.socket,
    roots: tuple[str, str],
    exclude: frozenset[str],
    progress: Callable[[str], None],
) -> Copied:
    async with (
        session(src, src_sock) as src_conn,
        session(dst, dst_sock) as dst_conn,
        await _sftp(src, src_conn) as src_sftp,
        await _sftp(dst, dst_conn) as dst_sftp,
    ):
        copied = await _copy(
            Side(src, src_sftp, roots[0]), Side(dst, dst_sftp, roots[1]), exclude, progress
        )
    return copied


def copy_home(
    src: Box,
    src_sock: socket.socket,
    dst: Box,
    dst_sock: socket.socket,
    *,
    src_root: str = "",
    dst_root: str = "",
    exclude: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _: None,
) -> Copied:
    """Copy what changed under `src_root` in box `src` to `dst_root` in box `dst`, over a
    connected socket to each. Roots "" are each session's start folder (its $HOME), and a
    relative root is relative to it; `exclude` paths are relative to the source root and
    take their subtrees with them (UsageError for one outside it). Nothing on the
    destination is deleted and nothing newer there is overwritten (devbox.ssh.homeplan
    says what is sent). `progress` gets a line now and then. A failure of either session
    is one DevboxError naming its box."""
    return asyncio.run(
        _copy_home(src, src_sock, dst, dst_sock, (src_root, dst_root), excludes(exclude), progress)
    )
