"""The user's devbox SSH key: made once, used for every box (and offered to OpenSSH)."""

from __future__ import annotations

import fcntl
import os
import stat
import sys
from pathlib import Path

from devbox import paths
from devbox import private as private_file
from devbox.errors import StateError


def _read_public(pub: Path, private: Path) -> str:
    try:
        line = pub.read_text().strip()
    except OSError as exc:
        raise StateError(f"cannot read {pub}: {exc.strerror}") from None
    if not line.startswith("ssh-"):
        raise StateError(f"{pub} is not an SSH public key; remove it and {private} to make anew")
    return line


def ensure_user_key(path: Path | None = None) -> str:
    """Return the public key line of the user's devbox key, creating the key on first use."""
    path = path or paths.user_key_file()
    pub = path.with_name(path.name + ".pub")
    if path.exists() and pub.exists():
        return _read_public(pub, path)
    private_file.ensure_dir(path.parent)
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two first-ever `devbox up`s must make one key
        if path.exists() and pub.exists():
            return _read_public(pub, path)
        return _generate(path, pub)
    finally:
        os.close(lock)


def _generate(path: Path, pub: Path) -> str:
    # Imported here: only the first claim ever pays for it.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    secret = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    line = f"{public} devbox@{os.uname().nodename}"
    private_file.write_bytes(path, secret)
    private_file.write_text(pub, line + "\n")
    return line


def check_user_key(path: Path | None = None, *, missing_ok: bool = False) -> None:
    """Make sure OpenSSH will use the user's devbox key, which it would otherwise skip in
    silence under devbox's LogLevel=QUIET (and `devbox ssh` exit 255 with no word).

    A key devbox made (a plain file of this user's) that others can read is made 0600
    again, said once on sys.stderr (which Textual captures in the TUI); a key another
    user owns, or a wide key behind a link (a dotfile manager's file, not devbox's to
    change), is refused with one line.
    """
    path = path or paths.user_key_file()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise StateError(
            f"your devbox key {path} is missing: your boxes accept only it; restore it, "
            "or release them and claim new ones (`devbox up` makes a new key)"
        ) from None
    link = stat.S_ISLNK(st.st_mode)
    if link:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise StateError(
                f"your devbox key {path} is a link to nothing: {exc.strerror}"
            ) from None
    me = os.geteuid()
    if st.st_uid != me:
        # Whoever owns it can read it (and log in as you) or swap it: never offer it.
        raise StateError(
            f"your devbox key {path} belongs to uid {st.st_uid}, not to you (uid {me}): "
            f"refusing to use it; if it is yours, `chown {me} {path}`, else remove it "
            f"and {path}.pub and claim your boxes anew"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 == 0 and mode & 0o400:
        return  # private, and readable by its owner
    if link:
        target = path.resolve()
        raise StateError(
            f"your devbox key {path} (a link to {target}) has mode {mode:04o}, which OpenSSH "
            f"refuses for a private key: `chmod 600 {target}`"
        )
    os.chmod(path, private_file.FILE_MODE)
    sys.stderr.write(
        f"devbox: warning: your devbox key {path} had mode {mode:04o}, which OpenSSH "
        f"refuses for a private key; made it {private_file.FILE_MODE:04o}\n"
    )
    sys.stderr.flush()
