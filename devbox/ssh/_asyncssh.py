"""The one place devbox's client imports asyncssh.

At import, asyncssh looks for the optional liboqs (sntrup761 key exchange) with
ctypes.util.find_library, twice; on Linux each call runs `ldconfig -p` and then
gcc: ~40 ms of every `devbox ssh`, a tenth of its run time. devbox's client only
talks to devbox agents, which agree on mlkem768x25519 through `cryptography`, so
the probe is skipped here (find_library answers None during the import).
cryptography's deprecations that asyncssh trips at import are hidden (devbox.libwarnings).
"""

from __future__ import annotations

import ctypes.util

from devbox.libwarnings import quiet_asyncssh

quiet_asyncssh()

_find_library = ctypes.util.find_library
ctypes.util.find_library = lambda name: None
try:
    import asyncssh
finally:
    ctypes.util.find_library = _find_library

__all__ = ["asyncssh"]
