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


def pin(box_name: str, host_key: str, path: Path | None = None) -> None:
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


def unpin(box_name: str, path: Path | None = None) -> None:
    path = path or paths.known_hosts_file()
    host = alias(box_name)
    with _locked(path):
        lines = _read(path)
        kept = [ln for ln in lines if ln.split(" ", 1)[0] != host]
        if kept != lines:
            _write(path, kept)
