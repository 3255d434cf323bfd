"""`devbox run`'s sync when rsync is missing (on the laptop or in the box): SFTP over devbox's
own client. Like rsync's quick check, a file is sent when the box has none of that name, or
one of another size or modification time; sent files keep their time, so the next sync
skips them. One READDIR per folder learns what the box has; uploads run a few at a time.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import session

PARALLEL = 16


async def _remote_files(sftp: asyncssh.SFTPClient, top: str) -> dict[str, tuple[int, int]]:
    """Relative path -> (size, mtime) of every file under `top` in the box."""
    found: dict[str, tuple[int, int]] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            names = await sftp.readdir(posixpath.join(top, rel) if rel else top)
        except asyncssh.SFTPNoSuchFile:
            continue
        for name in names:
            filename = str(name.filename)
            if filename in (".", ".."):
                continue
            path = f"{rel}/{filename}" if rel else filename
            attrs = name.attrs
            if attrs.permissions is not None and stat.S_ISDIR(attrs.permissions):
                pending.append(path)
            else:
                found[path] = (attrs.size or 0, int(attrs.mtime or 0))
    return found


async def _push(
    conn: asyncssh.SSHClientConnection, root: Path, files: Sequence[str], dest: str
) -> list[str]:
    async with conn.start_sftp_client() as sftp:
        have = await _remote_files(sftp, dest)
        todo = []
        for rel in files:
            st = os.stat(root / rel)
            if have.get(rel) != (st.st_size, int(st.st_mtime)):
                todo.append(rel)
        folders = sorted({posixpath.dirname(rel) for rel in todo} | {""})
        for folder in folders:
            await sftp.makedirs(posixpath.join(dest, folder) if folder else dest, exist_ok=True)
        gate = asyncio.Semaphore(PARALLEL)

        async def send(rel: str) -> None:
            async with gate:
                await sftp.put(str(root / rel), posixpath.join(dest, rel), preserve=True)

        await asyncio.gather(*(send(rel) for rel in todo))
    return todo


def push(box: Box, sock: socket.socket, root: Path, files: Sequence[str], dest: str) -> list[str]:
    """Send what changed of `files` (relative to `root`) to `dest` in the box (relative to its
    home); returns the paths sent."""

    async def main() -> list[str]:
        async with session(box, sock) as conn:
            try:
                return await _push(conn, root, files, dest)
            except asyncssh.SFTPError as exc:
                raise DevboxError(f"syncing to box {box.name} failed: {exc.reason}") from None

    return asyncio.run(main())
