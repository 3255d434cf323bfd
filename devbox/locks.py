"""Liveness by flock: a process holds an exclusive lock for its whole life, and the kernel
drops it however the process ends (an agent's lock file, a run's wrapper)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_held(path: Path) -> bool:
    """Whether some process holds `path`'s flock; probing takes a shared lock for an instant."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False
