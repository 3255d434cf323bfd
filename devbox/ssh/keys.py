"""The user's devbox SSH key: made once, used for every box (and offered to OpenSSH)."""

from __future__ import annotations

import fcntl
import os
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
