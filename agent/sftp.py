"""The agent's SFTP server, which asyncssh's scp server (`scp -O`) also goes through.

Paths mean what they mean under OpenSSH: relative ones start at the session's $HOME (where
sftp-server runs), and `~` is that $HOME, as the shell that runs sshd's `scp -t ~/f`
expands it. Its traffic counts as the box's activity, and the session ends with an exit
status."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath

import asyncssh
from asyncssh.misc import MaybeAwait

from agent.activity import Activity

log = logging.getLogger("devbox.agent")

# What a request counts for besides the file data it moves (about a request and its reply
# on the wire): a client that only stats and lists still shows up, a keepalive does not.
REQUEST_COST = 64


def resolve(path: bytes, home: bytes) -> bytes:
    """The local path a client's `path` names: `~` and `~/x` are in `home`, and so are
    relative paths; absolute ones are left as they are."""
    if path == b"~" or path.startswith(b"~/"):
        return home + path[1:]
    if path.startswith(b"/"):
        return path
    return posixpath.join(home, path) if path else home


class SFTPServer(asyncssh.SFTPServer):
    def __init__(
        self, chan: asyncssh.SSHServerChannel[bytes], *, home: str, activity: Activity
    ) -> None:
        super().__init__(chan)
        self._home = os.fsencode(home)
        self._activity = activity
        log.info("session: sftp")

    def map_path(self, path: bytes) -> bytes:
        # Every request that names a path comes through here: the per-request cost.
        self._activity.traffic("sftp", REQUEST_COST)
        return resolve(path, self._home)

    def read(self, file_obj: object, offset: int, size: int) -> MaybeAwait[bytes]:
        data = super().read(file_obj, offset, size)
        if isinstance(data, bytes):  # the base class reads a local file: never a coroutine
            self._activity.traffic("sftp", len(data))
        return data

    def write(self, file_obj: object, offset: int, data: bytes) -> MaybeAwait[int]:
        self._activity.traffic("sftp", len(data))
        return super().write(file_obj, offset, data)

    def exit(self) -> None:
        # Without an exit status OpenSSH's scp (which speaks SFTP) reports failure after
        # a complete copy.
        super().exit()
        chan = self.channel
        with contextlib.suppress(OSError, asyncssh.Error):
            chan.exit(0)  # a no-op when the channel is already closing
