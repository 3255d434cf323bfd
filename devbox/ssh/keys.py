"""The user's devbox SSH key: made once, used for every box (and offered to OpenSSH)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from devbox import paths
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
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    private = key.private_bytes(
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
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    pub_tmp = pub.with_name(pub.name + ".tmp")
    pub_tmp.write_text(line + "\n")
    os.replace(pub_tmp, pub)
    os.replace(tmp, path)
    return line
