"""Where devbox keeps things, following the XDG base-directory conventions."""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var, "")
    # The spec says relative paths are invalid and must be ignored.
    if value and os.path.isabs(value):
        return Path(value)
    return Path(os.path.expanduser("~")) / fallback


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config") / "devbox"


def state_dir() -> Path:
    return _xdg("XDG_STATE_HOME", ".local/state") / "devbox"


def config_file() -> Path:
    return config_dir() / "config.toml"


def user_key_file() -> Path:
    """The user's devbox SSH key (private half; `.pub` beside it)."""
    return config_dir() / "id_ed25519"


def known_hosts_file() -> Path:
    """devbox-managed known_hosts: the pinned host key of every box, and nothing else."""
    return state_dir() / "known_hosts"


def ssh_config_file() -> Path:
    """The devbox-managed OpenSSH config that `~/.ssh/config` includes."""
    return config_dir() / "ssh_config"


def user_ssh_config() -> Path:
    return Path(os.path.expanduser("~")) / ".ssh" / "config"


def local_settings_file() -> Path:
    """The local backend's autoscaler settings (a Kubernetes cluster keeps its own)."""
    return config_dir() / "autoscaler.toml"


def cluster_routes_file() -> Path:
    """Where each box of several clusters was last seen (devbox.backends.clusters); a TAB
    offers those names too."""
    return state_dir() / "clusters.json"
