"""Becoming the box's owner: an in-pod agent starts as root (with CHOWN, FOWNER, SETUID,
SETGID and SETPCAP only) because a warm pod's owner is not known when it starts. When a claim
names the owner, it makes the owner's home on the shared volume, mode 0700 and owned by
the owner's uid, and then becomes that uid for good, as sshd does for a session. Every
session, SFTP request and forward is then the owner's, and another user's folder on the
same volume is another uid's 0700 folder: the kernel keeps them apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import stat
from pathlib import Path

from devbox import protocol

UID_BASE = 200_000  # above the uids an image or a node's users have
UID_SPAN = 1 << 30
REGISTRY = ".devbox-uids"  # on the volume: which user each uid stands for
PR_CAPBSET_DROP = 24  # <linux/prctl.h>


class OwnerError(Exception):
    """The owner cannot be taken on here (their home or uid is someone else's)."""


def owner_uid(username: str) -> int:
    """The same uid for a user in every box, so their files stay theirs from box to box."""
    digest = hashlib.sha256(username.encode()).digest()
    return UID_BASE + int.from_bytes(digest[:8], "big") % UID_SPAN


def become(
    username: str,
    login: str,
    home_root: Path,
    *,
    also_own: tuple[Path, ...] = (),
    accounts: Path = Path("/etc"),
) -> Path:
    """Make `username`'s home under home_root, hand `also_own` (the probe socket) to them,
    and switch this process to their uid. Returns the home. Root only."""
    uid = owner_uid(username)
    _tighten_root(home_root)
    _register(home_root, uid, username)
    home = home_root / protocol.home_folder(username)
    _make_home(home, uid)
    _add_account(accounts, login, uid, home)
    for path in also_own:
        os.chown(path, uid, uid, follow_symlinks=False)
    _drop_bounding_set()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # glibc applies it to every thread of the process
    return home


def _drop_bounding_set() -> None:
    """Nothing the owner runs can ever hold a capability again, whatever file it runs
    (no_new_privs already stops setuid files; this stops file capabilities too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(_last_cap() + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # EINVAL: a capability this kernel does not know
                raise OSError(err, f"cannot drop capability {cap} from the bounding set")


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 63


def _tighten_root(home_root: Path) -> None:
    # Others may pass through to their own folder but not list who else has one.
    info = os.lstat(home_root)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) != 0o711:
        os.chmod(home_root, 0o711)


def _register(home_root: Path, uid: int, username: str) -> None:
    """Claims `uid` for `username` on this volume, once: two names whose hashes met would
    otherwise share a uid, and so each other's files."""
    folder = home_root / REGISTRY
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise OwnerError(f"{folder} is not a folder") from None
    entry = folder / str(uid)
    try:
        fd = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            if f.read() != username:
                raise OwnerError(f"uid {uid} already stands for another user") from None
        return
    with os.fdopen(fd, "w") as f:
        f.write(username)


def _make_home(home: Path, uid: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(home, 0o700)
    # Through a descriptor of the folder itself: a name swapped for a symlink between a
    # look and a change could otherwise hand something else to the owner. O_PATH: this
    # root has no DAC capability, so it could not open the owner's 0700 folder to read.
    try:
        fd = os.open(home, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (NotADirectoryError, FileNotFoundError) as exc:  # a symlink or a file
        raise OwnerError(f"{home} is not a folder") from exc
    try:
        info = os.fstat(fd)
        # chown and chmod take no O_PATH descriptor; its /proc link is that same folder.
        same = f"/proc/self/fd/{fd}"
        if info.st_uid == 0:  # made just now, or by the kubelet for a subPath mount
            os.chown(same, uid, uid)
        elif info.st_uid != uid:
            raise OwnerError(f"{home} belongs to uid {info.st_uid}, not the owner's {uid}")
        os.chmod(same, 0o700)
    finally:
        os.close(fd)


def _add_account(accounts: Path, login: str, uid: int, home: Path) -> None:
    """An /etc/passwd line, so that screen, ssh tools and the prompt know who they run as."""
    # A user name may hold anything, ":" and newlines too: such a home is not written
    # (the agent sets $HOME itself), so no name can add a line of its own.
    shown = str(home) if str(home).isprintable() and ":" not in str(home) else "/"
    line = f"{login}:x:{uid}:{uid}::{shown}:/bin/bash\n"
    try:
        with open(accounts / "passwd", "a") as f:
            f.write(line)
        with open(accounts / "group", "a") as f:
            f.write(f"{login}:x:{uid}:\n")
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES):
            raise
        # A read-only root file system: the tools that ask fall back to the uid.
