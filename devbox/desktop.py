"""Desktop notifications on the laptop, through `notify-send` where there is one: for the
user who is somewhere else than the terminal that has something to say (a run that ended,
a box about to be released)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess


def notify(summary: str, body: str) -> bool:
    """Show one notification; False when there is no `notify-send` or it failed. Never
    touches this process's stdout (a ProxyCommand's is the SSH stream)."""
    program = shutil.which("notify-send")
    if program is None:
        return False
    # No notification daemon (a server, a bare X session): the caller has said it elsewhere.
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(
            [program, "--app-name=devbox", summary, body],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=5,
            check=False,
        )
        return done.returncode == 0
    return False
