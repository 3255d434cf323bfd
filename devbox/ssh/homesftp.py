"""One box's SFTP session as a home copy (devbox.ssh.homecopy) uses it: listing a folder,
and writing one file or link so that nothing half-written or written through a link is
ever left under a real name.

- A file's data goes to a temporary name in its destination folder, created exclusively
  (O_EXCL: never a link someone planted there, never an older leftover), gets the source's
  permission bits and mtime, and is then renamed over the real name (posix-rename where the
  server offers it): an interrupted copy never leaves a half file under the real name, and
  a rename replaces a link there rather than writing through it.
- Data streams in chunks, the next one read while the last is written: a file is never
  whole in memory.
- A request's failure is said in one line naming its box; one about a single path (gone,
  or refused) is a Refused, which the copy turns into a skip of that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import stat
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import replace
from typing import Any

from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.homeplan import Entry, Kind, temp_name

PARALLEL = 16  # files being sent, or folders being listed, at once (as sftpsync)
CHUNK = 1 << 20  # one read or write; asyncssh pipelines it as several requests
CLEANUP_SECONDS = 5.0  # removing a temporary file after a failure waits no longer
# Only the permission bits travel: setuid, setgid and sticky would carry an identity, and
# on the other box the files belong to another account.
PERMS = 0o777

_LOST = (
    asyncssh.SFTPConnectionLost,
    asyncssh.SFTPNoConnection,
    asyncssh.ConnectionLost,
    asyncssh.DisconnectError,
    ConnectionError,
)
_KINDS = {
    stat.S_IFREG: Kind.FILE,
    stat.S_IFDIR: Kind.FOLDER,
    stat.S_IFLNK: Kind.LINK,
    stat.S_IFIFO: Kind.FIFO,
    stat.S_IFSOCK: Kind.SOCKET,
    stat.S_IFCHR: Kind.DEVICE,
    stat.S_IFBLK: Kind.DEVICE,
}


class Refused(DevboxError):
    """The box would not read or write one path, or it is gone: that path is skipped.
    Uncaught, it is the copy's one-line error."""

    def __init__(self, message: str, *, why: str) -> None:
        super().__init__(message)
        self.why = why


@contextlib.contextmanager
def guard(box: Box, path: str, doing: str, *, reading: bool = False) -> Iterator[None]:
    """A request to `box` about `path`. A lost session is one line naming this box: each
    side's requests are guarded apart, so whichever side's request was waiting when the
    other one died, the line names the one that died. A path that is gone or forbidden is
    a Refused, and so is any failure to read a source file (a bad sector, a file turned
    folder since the listing: that file's trouble); other failures end the copy (a full
    disk on the destination would fail every file after)."""
    what = f"{doing} {path}" if path else doing
    try:
        yield
    except _LOST as exc:
        why = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
        raise DevboxError(f"lost the connection to box {box.name}: {why}") from None
    except asyncssh.SFTPError as exc:
        if reading or isinstance(exc, asyncssh.SFTPNoSuchFile | asyncssh.SFTPPermissionDenied):
            raise Refused(
                f"box {box.name}: cannot {what}: {exc.reason}",
                why=f"box {box.name}: cannot {doing} it: {exc.reason}",
            ) from None
        raise DevboxError(f"box {box.name}: cannot {what}: {exc.reason}") from None
    except asyncssh.Error as exc:  # the SFTP channel itself refused, say
        raise DevboxError(f"box {box.name}: cannot {what}: {exc.reason}") from None


async def all_of(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run them all at once; on the first failure cancel the rest, let them clean up, and
    raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def each(items: Iterable[str], work: Callable[[str], Coroutine[Any, Any, None]]) -> None:
    """`work` on every item, PARALLEL at a time; the workers share one iterator (no task
    per item: a home may hold millions of files)."""
    shared = iter(items)

    async def worker() -> None:
        for item in shared:
            await work(item)

    await all_of(worker() for _ in range(PARALLEL))


def entry_of(attrs: asyncssh.SFTPAttrs) -> Entry:
    mode = attrs.permissions
    if mode is None:
        return Entry(Kind.OTHER)
    kind = _KINDS.get(stat.S_IFMT(mode), Kind.OTHER)
    return Entry(kind, size=attrs.size or 0, mtime=int(attrs.mtime or 0), mode=mode & PERMS)


def stamp(entry: Entry, *, mode: bool = True) -> asyncssh.SFTPAttrs:
    """The attributes that make a copy look like `entry` (SFTP v3 sets both times or none)."""
    return asyncssh.SFTPAttrs(
        permissions=entry.mode if mode else None, atime=entry.mtime, mtime=entry.mtime
    )


def under(root: str, rel: str) -> str:
    """The path the SFTP server is asked for: `rel` under `root`. Root "" is the session's
    start folder, its $HOME, as relative paths are."""
    if not rel:
        return root or "."
    return posixpath.join(root, rel) if root else rel


class Side:
    """One box's SFTP session and the root a copy's relative paths are under."""

    def __init__(self, box: Box, sftp: asyncssh.SFTPClient, root: str) -> None:
        self.box = box
        self.sftp = sftp
        self.root = root.rstrip("/") or root

    def path(self, rel: str) -> str:
        return under(self.root, rel)

    def guard(
        self, rel: str, doing: str, *, reading: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return guard(self.box, self.path(rel), doing, reading=reading)

    async def stat(self, rel: str) -> Entry | None:
        """What is at `rel`, following a link (used for the roots only); None: nothing."""
        try:
            with self.guard(rel, "read"):
                return entry_of(await self.sftp.stat(self.path(rel)))
        except Refused:
            return None

    async def listdir(self, rel: str) -> dict[str, Entry]:
        with self.guard(rel, "list"):
            names = await self.sftp.readdir(self.path(rel))
        found = {str(n.filename): entry_of(n.attrs) for n in names if n.filename not in (".", "..")}

        async def target(name: str) -> None:
            child = posixpath.join(rel, name)
            with self.guard(child, "read the link"):
                text = await self.sftp.readlink(self.path(child))
            found[name] = replace(found[name], target=str(text))

        await all_of(target(n) for n, e in found.items() if e.kind is Kind.LINK)
        return found

    async def setstat(self, rel: str, attrs: asyncssh.SFTPAttrs) -> None:
        with self.guard(rel, "set the mode and time of"):
            await self.sftp.setstat(self.path(rel), attrs)

    async def rename(self, tmp: str, rel: str) -> None:
        with self.guard(rel, "rename into"):
            try:
                await self.sftp.posix_rename(self.path(tmp), self.path(rel))
            except asyncssh.SFTPOpUnsupported:
                # A plain SFTP v3 rename refuses an existing target: remove it (the entry
                # itself, never what a link there points to), then rename; not atomic.
                with contextlib.suppress(asyncssh.SFTPNoSuchFile):
                    await self.sftp.remove(self.path(rel))
                await self.sftp.rename(self.path(tmp), self.path(rel))

    async def discard(self, tmp: str) -> None:
        """Best effort: where the session is gone, the next copy removes the file."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.sftp.remove(self.path(tmp)), CLEANUP_SECONDS)


async def _read(src: Side, rel: str, reader: asyncssh.SFTPClientFile, at: int, n: int) -> bytes:
    with src.guard(rel, "read", reading=True):
        data = await reader.read(n, at)
    assert isinstance(data, bytes)  # opened in binary mode
    return data


async def _pump(
    src: Side,
    dst: Side,
    rel: str,
    size: int,
    files: tuple[asyncssh.SFTPClientFile, asyncssh.SFTPClientFile],
    sent: Callable[[int], None],
) -> None:
    """Read the next chunk while the last is written. A read asks for one byte more than
    the listed size leaves, so a short answer at that size is the end: no round trip to
    read an empty one (a file that changes meanwhile is caught by the next copy, its time
    being newer than the one set here)."""
    reader, writer = files

    def read(at: int) -> tuple[int, asyncio.Future[bytes]]:
        left = size - at
        n = left + 1 if 0 <= left < CHUNK else CHUNK
        return n, asyncio.ensure_future(_read(src, rel, reader, at, n))

    offset = 0
    asked, ahead = read(offset)
    try:
        while data := await ahead:
            end = offset + len(data)
            last = len(data) < asked and end == size
            if not last:
                asked, ahead = read(end)
            with dst.guard(rel, "write"):
                await writer.write(data, offset)
            offset = end
            sent(len(data))
            if last:
                break
    finally:
        ahead.cancel()
        # Its failure is the one the write raised with, or moot.
        ahead.add_done_callback(lambda t: t.cancelled() or t.exception())


@contextlib.asynccontextmanager
async def _closing(
    side: Side, rel: str, file: asyncssh.SFTPClientFile, *, reading: bool = False
) -> AsyncIterator[None]:
    """Close `file` after the body. After a failure, quietly and briefly: the failure is
    the one to tell (its box may be the one gone, and then this close cannot be answered)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(file.close(), CLEANUP_SECONDS)
        raise
    with side.guard(rel, "read" if reading else "write", reading=reading):
        await file.close()


async def send_file(
    src: Side, dst: Side, rel: str, entry: Entry, sent: Callable[[int], None]
) -> None:
    """The regular file `rel` from `src` to `dst`, as `entry` lists it; `sent` hears of
    every chunk written."""
    tmp = posixpath.join(posixpath.dirname(rel), temp_name())
    with src.guard(rel, "read", reading=True):
        reader = await src.sftp.open(src.path(rel), "rb")
    async with _closing(src, rel, reader, reading=True):
        with dst.guard(rel, "write"):
            writer = await dst.sftp.open(
                dst.path(tmp),
                asyncssh.FXF_WRITE | asyncssh.FXF_CREAT | asyncssh.FXF_EXCL,
                asyncssh.SFTPAttrs(permissions=0o600),
                encoding=None,
            )
        try:
            async with _closing(dst, rel, writer):
                await _pump(src, dst, rel, entry.size, (reader, writer), sent)
                with dst.guard(rel, "write"):
                    await writer.setstat(stamp(entry))
            await dst.rename(tmp, rel)
        except BaseException:
            await dst.discard(tmp)
            raise


async def send_link(dst: Side, rel: str, entry: Entry) -> None:
    """The link `rel` on `dst`, with `entry`'s target text, made or replacing what is there."""
    tmp = posixpath.join(posixpath.dirname(rel), temp_name())
    with dst.guard(rel, "make the link"):
        await dst.sftp.symlink(entry.target, dst.path(tmp))
    try:
        # The link's own time (lsetstat), so that newer-wins reads alike on both sides; a
        # server without lsetstat leaves it the time of the copy.
        with dst.guard(rel, "set the time of"), contextlib.suppress(asyncssh.SFTPOpUnsupported):
            await dst.sftp.utime(dst.path(tmp), (entry.mtime, entry.mtime), follow_symlinks=False)
        await dst.rename(tmp, rel)
    except BaseException:
        await dst.discard(tmp)
        raise
