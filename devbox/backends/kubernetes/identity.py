"""Who the user is, as the API server says (a SelfSubjectReview, what `kubectl auth
whoami` asks), and the names derived from it: the owner label, the home folder.

Never `$USER`: the laptop's login name is whatever the laptop says, and two people whose
login names are both `root` would own each other's boxes. The API server has checked the
credentials, so its answer is the one the admission policies (images/k8s/policies.yaml)
compare a box's owner with.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from devbox import paths, protocol
from devbox.backends.kubernetes.kubeconfig import Endpoint
from devbox.backends.kubernetes.rest import Rest
from devbox.errors import DevboxError

REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


@dataclass(frozen=True)
class Identity:
    username: str
    groups: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return protocol.owner_label(self.username)

    @property
    def home(self) -> str:
        return protocol.home_folder(self.username)


def whoami(rest: Rest) -> Identity:
    """The API server's answer, cached per credential (it cannot change for one)."""
    cache = _cache_file(rest.endpoint)
    if cache is not None:
        cached = _read_cache(cache)
        if cached is not None:
            return cached
    answer = rest.post(
        REVIEW, {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    )
    info = (answer.get("status") or {}).get("userInfo") or {}
    username = str(info.get("username") or "")
    if not username:
        raise DevboxError("the API server did not say who you are (SelfSubjectReview)")
    identity = Identity(username, tuple(str(g) for g in info.get("groups") or ()))
    if cache is not None:
        _write_cache(cache, identity)
    return identity


def _cache_file(endpoint: Endpoint) -> Path | None:
    # Keyed by the credential itself: a new certificate or token is asked about afresh.
    secret = endpoint.cert_pem + endpoint.token.encode()
    if not secret:
        return None  # a credential devbox does not see: ask every time
    key = hashlib.sha256(endpoint.server.encode() + b"\0" + secret).hexdigest()[:32]
    return paths.state_dir() / "identity" / f"{key}.json"


def _read_cache(path: Path) -> Identity | None:
    try:
        data = json.loads(path.read_text())
        return Identity(str(data["username"]), tuple(str(g) for g in data.get("groups", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: Path, identity: Identity) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"username": identity.username, "groups": list(identity.groups)}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache only: the next command asks again
