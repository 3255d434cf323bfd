"""How devbox's client (devbox.ssh) and the agent import asyncssh: quietly, and fast.

- Quietly: cryptography deprecates algorithms before asyncssh stops naming them. From
  cryptography 51 every import of asyncssh printed five DSA warnings (ten lines) to stderr,
  above each one-line error of the CLI and at the top of every agent log. devbox offers and
  accepts none of those algorithms (ed25519 keys; curve25519, ML-KEM and sntrup761 key
  exchange), so the deprecation is asyncssh's news, not the user's. Only warnings
  attributed to asyncssh's own modules are hidden; the same deprecation raised by devbox's
  code would still show.
- Fast: at import, asyncssh looks for the optional liboqs (sntrup761) with
  ctypes.util.find_library, twice; on Linux a library that is not there costs each call
  `ldconfig -p`, gcc and ld: ~40 ms of every `devbox ssh` and of every agent's start, for a
  library Debian 12 does not package. Under `importing()` that search answers None at once:
  the client agrees on mlkem768x25519 with devbox agents (through `cryptography`), and the
  agent offers sntrup761 from the pq extra instead (agent.pqkex). The agent's search for
  libnettle (UMAC, for clients on AES-CTR) is left alone; the client, which never uses
  UMAC with a devbox agent, skips that one too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


def quiet() -> None:
    """Hide cryptography's deprecations of algorithms asyncssh names, from here on."""
    warnings.filterwarnings("ignore", message=r".*\bis deprecated\b", module=r"asyncssh(\.|$)")


@contextlib.contextmanager
def importing(*, umac: bool = False) -> Iterator[None]:
    """Around the first `import asyncssh` of a process: quiet, and no search for liboqs
    (nor for libnettle, unless `umac`)."""
    import ctypes.util

    quiet()
    find_library = ctypes.util.find_library
    skipped = ("oqs",) if umac else ("oqs", "nettle")
    ctypes.util.find_library = lambda name: (
        None if any(s in name for s in skipped) else find_library(name)
    )
    try:
        yield
    finally:
        ctypes.util.find_library = find_library
