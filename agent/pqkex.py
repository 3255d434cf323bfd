"""sntrup761x25519-sha512, the post-quantum hybrid key exchange OpenSSH 9.0-9.8 prefers
(Debian 12's 9.2, Ubuntu 24.04's 9.6), offered from the `pqcrypto` wheel; 8.5-8.9 have it too.

asyncssh has this exchange only through liboqs, which Debian 12 does not package; without
it those clients fall back to curve25519, which a recorded session gives up to a future
quantum computer. `pqcrypto` (an optional dependency, the `pq` extra: see pyproject.toml)
has sntrup761's encapsulation in a manylinux wheel. It is plugged in at the narrowest point
asyncssh has: its key exchange registry takes, for a hybrid exchange, a KEM class.

The asyncssh names relied on (pyproject.toml pins asyncssh's range for the private one):
- asyncssh.kex.register_kex_alg(alg, handler, hash, args, default) and get_kex_algs();
- asyncssh.kex_dh._KexHybridECDH, whose args are (KEM class, KEM name, ECDH class)
  since 2.24 (2.23 had no KEM class) and which calls the KEM as asyncssh.crypto.pq.PQKey:
  Cls(name), get_public(), encaps(public) -> (secret, ciphertext), decaps(ciphertext);
- asyncssh.crypto.Curve25519DH.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

log = logging.getLogger("devbox.agent")

ALGS = (b"sntrup761x25519-sha512", b"sntrup761x25519-sha512@openssh.com")


class Sntrup761:
    """asyncssh's PQKey protocol over pqcrypto's sntrup761. A server only encapsulates,
    so the key pair (50 ms of keygen) is made only when a client asks for its public key."""

    # OpenSSH's sntrup761.h: public key, secret key, ciphertext, shared secret.
    pubkey_bytes = 1158
    privkey_bytes = 1763
    ciphertext_bytes = 1039
    secret_bytes = 32

    def __init__(self, alg_name: bytes) -> None:
        from pqcrypto.kem import sntrup_761

        self._kem: Any = sntrup_761
        self._keys: tuple[bytes, bytes] | None = None

    def get_public(self) -> bytes:
        if self._keys is None:
            self._keys = self._kem.keygen()
        return self._keys[0]

    def encaps(self, peer_public: bytes) -> tuple[bytes, bytes]:
        if len(peer_public) != self.pubkey_bytes:
            raise ValueError("invalid sntrup761 public key")  # asyncssh: ProtocolError
        ciphertext, secret = self._kem.encaps(peer_public)
        return secret, ciphertext

    def decaps(self, ciphertext: bytes) -> bytes:
        if len(ciphertext) != self.ciphertext_bytes:
            raise ValueError("invalid sntrup761 ciphertext")
        self.get_public()
        assert self._keys is not None
        secret: bytes = self._kem.decaps(self._keys[1], ciphertext)
        return secret


def register() -> bool:
    """Adds sntrup761x25519 to asyncssh's key exchanges where it lacks them and the wheel
    is installed; whether this asyncssh now has them. Called where the agent sets up its
    server, so the wheel's import (a 2.6 MB library) is not paid by anything else."""
    from asyncssh.kex import get_kex_algs, register_kex_alg

    have = set(get_kex_algs())
    if all(alg in have for alg in ALGS):
        return True  # asyncssh found liboqs itself
    try:
        from pqcrypto.kem import sntrup_761
    except ImportError:
        return False
    sizes = (sntrup_761.PUBLIC_KEY_SIZE, sntrup_761.CIPHERTEXT_SIZE)
    if sizes != (Sntrup761.pubkey_bytes, Sntrup761.ciphertext_bytes):
        log.warning("pqcrypto's sntrup761 is not OpenSSH's: not offered")
        return False
    from asyncssh.crypto import Curve25519DH
    from asyncssh.kex_dh import _KexHybridECDH

    for alg in ALGS:
        if alg not in have:
            # Not among asyncssh's defaults: only the agent, which names its list, offers it.
            register_kex_alg(
                alg, _KexHybridECDH, hashlib.sha512, (Sntrup761, b"sntrup761", Curve25519DH), False
            )
    return True
