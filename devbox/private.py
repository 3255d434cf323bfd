"""Files only their owner may read: devbox's folders are 0700 and its files 0600.

On a shared workstation other users must not read a box's home (an `.env` with an API
key), its logs or its records, whatever the user's umask and however old the tree is
(devbox before 0700 state left it 0755/0644, so folders are tightened when next used).
Standard library only: the in-box side of `devbox run` uses it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from devbox.errors import StateError

DIR_MODE = 0o700
FILE_MODE = 0o600


def ensure_dir(path: Path) -> Path:
    """`path` as a 0700 folder of this user's, made (with missing parents, 0700 as the XDG
    spec asks) or tightened; one clear error if another user owns it."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a concurrent devbox made it first
            os.mkdir(folder, DIR_MODE)
    st = os.stat(path)  # a symlink the user made (dotfiles) is followed: its target is checked
    if not stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is not a folder")
    _check_owner(path, st)
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def _check_owner(path: Path, st: os.stat_result) -> None:
    # Another user's folder could be read (or swapped) by them: never keep state in it.
    if st.st_uid != os.geteuid():
        raise StateError(
            f"{path} belongs to uid {st.st_uid}, not to you; devbox keeps no state there"
        )


def tighten(paths: Iterable[Path]) -> None:
    """Make this user's existing files 0600 and folders 0700; symlinks and missing are left."""
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.geteuid() or stat.S_ISLNK(st.st_mode):
            continue  # chmod would follow a link: only the user's own plain entries
        mode = DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)


def tighten_folder(path: Path) -> None:
    """`path` and what lies directly in it (files, not subfolders' contents) made private."""
    try:
        entries = list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    tighten([path, *entries])


def write_text(path: Path, text: str) -> None:
    """Replace `path` atomically (never half a file) with a 0600 file holding `text`."""
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    # mkstemp: a new 0600 file (O_EXCL), never a leftover or a link with a wider mode.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_append(path: Path) -> int:
    """A 0600 log opened for appending; an older, wider one is tightened. Never via a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def remove_own_temp_folder(folder: Path, prefix: str) -> None:
    """Delete `folder` if it is one this user made with tempfile.mkdtemp(prefix=prefix): a
    real folder (no symlink) so named, owned by this uid. Its path comes from a file that
    whatever runs in the box can rewrite, so it is checked, not trusted. (Not checked: which
    temp folder it is in, as $TMPDIR differs between the agents of one box.)"""
    if not folder.name.startswith(prefix):
        return
    try:
        st = os.lstat(folder)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        shutil.rmtree(folder, ignore_errors=True)  # by descriptors: never follows a link
