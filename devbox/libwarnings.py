"""Warnings of the libraries devbox builds on that say nothing to devbox's users.

cryptography deprecates algorithms before asyncssh stops naming them: from cryptography 51
every import of asyncssh printed five DSA warnings (ten lines) to stderr, above each one-line
error of the CLI and at the top of every agent log. devbox offers and accepts none of those
algorithms (ed25519 keys; curve25519 and ML-KEM key exchange), so the deprecation is asyncssh's
news, not the user's. Only warnings attributed to asyncssh's own modules are hidden; the same
deprecation raised by devbox's code would still show.
"""

from __future__ import annotations

import warnings


def quiet_asyncssh() -> None:
    """Hide cryptography's deprecations of algorithms asyncssh names; call before importing it."""
    warnings.filterwarnings("ignore", message=r".*\bis deprecated\b", module=r"asyncssh(\.|$)")
