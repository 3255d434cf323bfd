"""Backends turn a BoxSpec into a running box. `get` picks one by name, importing lazily
so that the kubernetes client loads only when that backend is used."""

from __future__ import annotations

from devbox.backends.base import Backend
from devbox.config import Config
from devbox.errors import UsageError


def get(name: str, config: Config) -> Backend:
    if name == "local":
        from devbox.backends.local import LocalBackend

        return LocalBackend(config=config)
    if name == "kubernetes":
        from devbox.backends.kubernetes import KubernetesBackend

        return KubernetesBackend(config=config)
    raise UsageError(f"unknown backend {name!r}")
