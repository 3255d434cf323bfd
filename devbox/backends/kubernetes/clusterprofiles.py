"""The profiles a lab administrator sets for a namespace: the ConfigMap `devbox-profiles`,
key `profiles.toml`, the same `[profiles.NAME]` tables as a user's config.toml."""

from __future__ import annotations

from typing import Any

from devbox import profiles
from devbox.backends.kubernetes.api import Cluster
from devbox.backends.kubernetes.rest import ApiError
from devbox.config import Config
from devbox.errors import UsageError
from devbox.profiles import Profile

CONFIG_MAP = "devbox-profiles"
KEY = "profiles.toml"


def read(cluster: Cluster) -> tuple[Profile, ...]:
    """The namespace's profiles; none when there is no such ConfigMap or the caller may
    not read it (403): cluster profiles are a convenience, never required."""
    try:
        found = cluster.rest.get(cluster.config_maps(CONFIG_MAP))
    except ApiError as exc:
        if exc.status in (403, 404):
            return ()
        raise
    return of_config_map(found, namespace=cluster.namespace)


def of_config_map(found: dict[str, Any], *, namespace: str) -> tuple[Profile, ...]:
    where = f"ConfigMap {namespace}/{CONFIG_MAP}"
    data = found.get("data") or {}
    if KEY not in data:
        raise UsageError(f"{where} has no key {KEY!r}")
    return profiles.parse_document(str(data[KEY]), source=where)


def catalog(cluster: Cluster, config: Config) -> dict[str, Profile]:
    """Every profile by name: built in, then the cluster's, then the user's own."""
    return profiles.resolve(read(cluster), config.profiles)
