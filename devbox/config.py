"""User configuration: one TOML file, validated strictly (a typo is an error, not a default)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from devbox import hang as hang_rule
from devbox import paths, profiles, saves
from devbox.errors import UsageError
from devbox.profiles import Profile

BACKENDS = ("local", "kubernetes")
MULTIPLEXERS = ("auto", "screen", "tmux", "none")
# A cluster's name in config.toml, in tables, on the command line and in `ls`: short, and
# safe in a file name and an ssh-config ProxyCommand.
_CLUSTER_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


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
    # Kubernetes: a kubeconfig file of this cluster's own; empty: $KUBECONFIG or ~/.kube/config.
    kubeconfig: str = ""
    # Several clusters ([clusters.NAME] tables), most preferred first; empty: one, the
    # settings above. A new pod that is not scheduled within schedule_timeout seconds is
    # deleted and the next cluster tried; a cluster that failed so is tried last for
    # failure_memory seconds.
    clusters: tuple[ClusterConfig, ...] = ()
    schedule_timeout: float = 10.0
    failure_memory: float = 60.0
    # Seconds `ls` (and every look-up by name) waits for a cluster before it reports it
    # as not answering: an API server answers a list in tens of milliseconds, and one
    # cluster's outage must not make every command slow.
    cluster_wait: float = 1.5
    # Seconds a release (`devbox down` without --now) gives the box's probed processes to
    # save (probe.on_release); 0: none. Kubernetes' default grace of 30 s is too short
    # for a large model's checkpoint.
    save_timeout: float = 120.0
    # What counts as hung, not busy ([hang] util, power, after; devbox.hang): given to
    # the agents of the boxes this user starts.
    hang: hang_rule.Rule = field(default_factory=hang_rule.Rule)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """One of several clusters: where it is (kubeconfig, context, namespace), how much it
    is preferred (lower first; the file's order breaks ties) and which profiles it offers
    (empty: all it knows)."""

    name: str
    preference: int
    profiles: tuple[str, ...] = ()
    # The whole Config of a box in this cluster: the top-level settings with this
    # cluster's own (context, namespace, kubeconfig, image, storage class...) over them.
    config: Config

    def offers(self, profile: str) -> bool:
        return not self.profiles or profile in self.profiles


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
    "kubeconfig": str,
    "schedule_timeout": float,
    "failure_memory": float,
    "cluster_wait": float,
    "save_timeout": float,
}
# What a [clusters.NAME] table may set: where the cluster is, and what differs between
# clusters (a storage class, an image registry); the rest is the user's, for all of them.
_CLUSTER_FIELDS: dict[str, type] = {
    key: _FIELDS[key]
    for key in (
        "context",
        "namespace",
        "kubeconfig",
        "image",
        "home_storage_class",
        "home_size",
        "service_account",
        "priority_class",
    )
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
    # Only with a file to read: the TOML parser (and the datetime it brings) is a tenth of
    # a command's start-up without one.
    import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    return _validate(data, path)


def _typed(key: str, value: Any, kind: type, where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be a {kind.__name__}")
    return value


def _validate(data: dict[str, Any], path: Path) -> Config:
    values: dict[str, Any] = {}
    where = f"config file {path}"
    for key, value in data.items():
        if key in ("profiles", "clusters", "hang"):
            continue
        if key in _REMOVED:
            raise UsageError(f"{where}: {key} was removed: {_REMOVED[key]}")
        kind = _FIELDS.get(key)
        if kind is None:
            raise UsageError(f"{where}: unknown setting {key!r}")
        values[key] = _typed(key, value, kind, where)
    if "profiles" in data:
        values["profiles"] = profiles.parse_table(data["profiles"], source=where)
    if "hang" in data:
        values["hang"] = hang_rule.parse(data["hang"], where=f"{where}: [hang]")
    if "clusters" in data and "backend" not in data:
        values["backend"] = "kubernetes"  # clusters are Kubernetes clusters
    config = Config(**values)
    for key, most in (("schedule_timeout", 3600), ("failure_memory", 3600), ("cluster_wait", 60)):
        seconds = getattr(config, key)
        if not 0 < seconds <= most:  # false for nan too
            raise UsageError(f"{where}: {key} must be in (0, {most}] seconds (got {seconds:g})")
    if not 0 <= config.save_timeout <= saves.MAX_LIMIT:
        raise UsageError(
            f"{where}: save_timeout must be in [0, {saves.MAX_LIMIT:g}] seconds "
            f"(got {config.save_timeout:g})"
        )
    if "clusters" in data:
        config = replace(config, clusters=_clusters(data["clusters"], config, where))
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


def _clusters(table: Any, base: Config, where: str) -> tuple[ClusterConfig, ...]:
    if not isinstance(table, dict) or not table:
        raise UsageError(f"{where}: clusters must be tables, as [clusters.NAME]")
    out = []
    for order, (name, entry) in enumerate(table.items()):
        if not _CLUSTER_NAME.match(name):
            raise UsageError(
                f"{where}: cluster name {name!r} must be 1-32 lowercase letters, digits or "
                "'-', starting and ending with a letter or digit"
            )
        here = f"{where}: [clusters.{name}]"
        if not isinstance(entry, dict):
            raise UsageError(f"{here} must be a table")
        own: dict[str, Any] = {}
        preference = order
        offered: tuple[str, ...] = ()
        for key, value in entry.items():
            if key == "preference":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise UsageError(f"{here}: preference must be a whole number >= 0")
                preference = value
            elif key == "profiles":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise UsageError(f"{here}: profiles must be a list of profile names")
                for profile in value:
                    profiles.check_name(profile, f"{here}: a profile name")
                offered = tuple(value)
            elif key in _CLUSTER_FIELDS:
                own[key] = _typed(key, value, _CLUSTER_FIELDS[key], here)
            else:
                raise UsageError(f"{here}: unknown setting {key!r}")
        if own.get("priority_class") and not _SUBDOMAIN.match(own["priority_class"]):
            raise UsageError(f"{here}: priority_class must be a PriorityClass name")
        out.append(
            ClusterConfig(
                name=name,
                preference=preference,
                profiles=offered,
                config=replace(base, **own),
            )
        )
    # Stable: equal preferences keep the file's order.
    return tuple(sorted(out, key=lambda c: c.preference))


def select_backend(flag: str | None, config: Config) -> str:
    """--backend beats DEVBOX_BACKEND beats the config file beats the local default."""
    choice = flag or os.environ.get("DEVBOX_BACKEND") or config.backend
    if choice not in BACKENDS:
        raise UsageError(f"unknown backend {choice!r}: choose one of {', '.join(BACKENDS)}")
    return choice
