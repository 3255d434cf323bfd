"""Persistent sessions: which multiplexer keeps a box's shell alive."""

from __future__ import annotations

import shutil

from devbox.boxes import Multiplexer


def choose(preference: str) -> Multiplexer:
    """auto: screen, else tmux, else none. An explicit choice that is missing falls to none
    (the agent then warns in the session rather than refusing to start)."""
    order = ["screen", "tmux"] if preference == "auto" else [preference]
    for kind in order:
        if kind == "none":
            break
        path = shutil.which(kind)
        if path:
            return Multiplexer(kind, path)
    return Multiplexer("none")
