"""User configuration: one TOML file, validated strictly (a typo is an error, not a default)."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devbox import paths, profiles
from devbox.errors import UsageError
from devbox.profiles import Profile

BACKENDS = ("local", "kubernetes")
MULTIPLEXERS = ("auto", "screen", "tmux", "none")


@dataclass(frozen=True, kw_only=True)
class Config:
    backend: str = "local"
    # Which terminal multiplexer keeps sessions alive; auto prefers screen, then tmux.
    multiplexer: str = "auto"
    # Seconds `devbox up` waits for a box to come up before giving up.
    start_timeout: float = 30.0
    # Kubernetes backend. Empty context/namespace: the kubeconfig's current ones.
    context: str = ""
    namespace: str = ""
    image: str = "ghcr.io/devbox/box:latest"
    # Storage class of the shared homes volume (ReadWriteMany); empty: the cluster default.
    home_storage_class: str = ""
    home_size: str = "100Gi"
    service_account: str = "devbox-agent"
    # The PriorityClass of every box pod, warm or claimed; empty: the cluster's default.
    # One priority for both, because a pod's priority is fixed at its creation: a warm pod
    # made at a lower one would stay preemptible after a user claimed it.
    priority_class: str = ""
    # The user's own [profiles.NAME] tables; they replace the cluster's of the same name.
    profiles: tuple[Profile, ...] = ()
    # Local backend: the agent's port (`devbox up --port`; 0: any free one). A flag only,
    # not a key of the config file: two boxes cannot share one port.
    port: int = 0


_FIELDS: dict[str, type] = {
    "backend": str,
    "multiplexer": str,
    "start_timeout": float,
    "context": str,
    "namespace": str,
    "image": str,
    "home_storage_class": str,
    "home_size": str,
    "service_account": str,
    "priority_class": str,
}
_REMOVED = {
    "warm_priority_class": "warm pods now run at priority_class, as every box (see README)",
}
# A PriorityClass name: a DNS-1123 subdomain.
_SUBDOMAIN = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


def load(path: Path | None = None) -> Config:
    """Read the config file; a missing file means defaults, a broken one is a UsageError."""
    path = path or paths.config_file()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    return _validate(data, path)


def _validate(data: dict[str, Any], path: Path) -> Config:
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "profiles":
            values[key] = profiles.parse_table(value, source=f"config file {path}")
            continue
        if key in _REMOVED:
            raise UsageError(f"config file {path}: {key} was removed: {_REMOVED[key]}")
        kind = _FIELDS.get(key)
        if kind is None:
            raise UsageError(f"config file {path}: unknown setting {key!r}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UsageError(f"config file {path}: {key} must be a {kind.__name__}")
        values[key] = value
    config = Config(**values)
    if config.backend not in BACKENDS:
        raise UsageError(f"config file {path}: backend must be one of {', '.join(BACKENDS)}")
    if config.multiplexer not in MULTIPLEXERS:
        raise UsageError(
            f"config file {path}: multiplexer must be one of {', '.join(MULTIPLEXERS)}"
        )
    if not 0 < config.start_timeout <= 3600:  # false for nan too
        raise UsageError(
            f"config file {path}: start_timeout must be in (0, 3600] seconds "
            f"(got {config.start_timeout:g})"
        )
    if config.priority_class and not (
        len(config.priority_class) <= 253 and _SUBDOMAIN.match(config.priority_class)
    ):
        raise UsageError(
            f"config file {path}: priority_class must be a PriorityClass name "
            f"(lowercase DNS subdomain), not {config.priority_class!r}"
        )
    return config


def select_backend(flag: str | None, config: Config) -> str:
    """--backend beats DEVBOX_BACKEND beats the config file beats the local default."""
    choice = flag or os.environ.get("DEVBOX_BACKEND") or config.backend
    if choice not in BACKENDS:
        raise UsageError(f"unknown backend {choice!r}: choose one of {', '.join(BACKENDS)}")
    return choice
