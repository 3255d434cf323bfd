"""The devbox-managed known_hosts file: one pinned host key per box, under the alias NAME.devbox.

OpenSSH (through the generated ssh-config's HostKeyAlias) and devbox's own client
both check a box against this pin, so a box that answers with another key is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from devbox import paths, private
from devbox.boxes import Box
from devbox.errors import DevboxError


def alias(box_name: str) -> str:
    return f"{box_name}.devbox"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    private.ensure_dir(path.parent)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # an older devbox made it 0644
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # concurrent `devbox up`s must not drop each other's pins
        yield
    finally:
        os.close(fd)


def _read(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _write(path: Path, lines: list[str]) -> None:
    private.write_text(path, "".join(line + "\n" for line in lines))


def pin(box_name: str, host_key: str, path: Path | None = None) -> list[str]:
    """Pin `host_key` as the box's only key; returns the other keys it replaced."""
    path = path or paths.known_hosts_file()
    host = alias(box_name)
    key = " ".join(host_key.split()[:2])
    with _locked(path):
        current = _read(path)
        lines = [ln for ln in current if ln.split(" ", 1)[0] != host]
        lines.append(f"{host} {key}")
        # `ssh-config` re-pins every box each time: a pin already there is not rewritten,
        # so a full state disk (or a read-only one) does not fail what changes nothing.
        if sorted(lines) != sorted(current):
            _write(path, lines)
    return [k for k in _keys_of(current, host) if k != key]


def pin_also(box_name: str, host_key: str, path: Path | None = None) -> None:
    """Pin `host_key` beside the box's other keys: while `devbox move` copies a home, two
    boxes of one name (its old and its new, each as its own cluster published it) serve."""
    path = path or paths.known_hosts_file()
    host = alias(box_name)
    key = " ".join(host_key.split()[:2])
    with _locked(path):
        current = _read(path)
        if key not in _keys_of(current, host):
            _write(path, [*current, f"{host} {key}"])


def _keys_of(lines: list[str], host: str) -> list[str]:
    # "NAMES TYPE BASE64 [COMMENT]"; markers (@revoked) and hashed names are never devbox's.
    keys = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and host in fields[0].split(","):
            keys.append(f"{fields[1]} {fields[2]}")
    return keys


def pinned(box_name: str, path: Path | None = None) -> list[str]:
    """The keys ("TYPE BASE64") this file pins for the box, as OpenSSH would read them."""
    return _keys_of(_read(path or paths.known_hosts_file()), alias(box_name))


def fingerprint(key: str) -> str:
    from devbox.protocol import fingerprint as sha256

    try:
        return sha256(key)
    except (ValueError, IndexError):  # binascii.Error is a ValueError
        return f"an unreadable key ({key[:20]}...)"


def check(box: Box, path: Path | None = None) -> None:
    """Refuse, in one line, a box whose published host key (its record's) is not the key
    pinned here, before OpenSSH refuses it with its banner or, under devbox's LogLevel=QUIET,
    in silence. A box with no pin gets its published key pinned, as `devbox ssh-config`
    does (it was claimed elsewhere, or its pin was removed to trust a new key)."""
    if not box.host_key:
        return  # nothing published to compare with: OpenSSH's own check decides
    path = path or paths.known_hosts_file()
    key = " ".join(box.host_key.split()[:2])
    keys = pinned(box.name, path)
    if key in keys:
        return
    if not keys:
        try:
            pin(box.name, box.host_key, path)
        except OSError as exc:
            raise DevboxError(
                f"cannot pin box {box.name}'s host key in {path}: {exc.strerror or exc}"
            ) from None
        return
    was = ", ".join(fingerprint(k) for k in keys)
    raise DevboxError(
        f"box {box.name}'s host key has changed: {path} pins {was}, but the box publishes "
        f"{fingerprint(key)}; if you re-created the box, `devbox ssh-config` pins its new "
        "key, else do not connect: something may be posing as it"
    )


def unpin(box_name: str, path: Path | None = None) -> None:
    path = path or paths.known_hosts_file()
    host = alias(box_name)
    with _locked(path):
        lines = _read(path)
        kept = [ln for ln in lines if ln.split(" ", 1)[0] != host]
        if kept != lines:
            _write(path, kept)
