"""The one place devbox's client imports asyncssh, quietly and without its library search
(devbox.sshlib)."""

from __future__ import annotations

from devbox import sshlib

with sshlib.importing():
    import asyncssh

__all__ = ["asyncssh"]
