"""The autoscaler's settings: one TOML document (a file locally, a ConfigMap's
`autoscaler.toml` in the cluster), validated strictly at start. A bad value is a one-line
UsageError naming the setting, never a silent default."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from typing import Any

from devbox import saves, units
from devbox.errors import UsageError
from devbox.profiles import check_name

SIGNALS = ("input", "forwards", "sftp", "stdin", "clients", "gpu", "cpu", "probe", "runs")
# An attached session nobody types in is not use (it is how GPUs get held overnight), so
# "clients" is off unless configured; the warning reaches that session, and a key pressed
# there is input.
DEFAULT_SIGNALS = ("input", "forwards", "sftp", "stdin", "gpu", "cpu", "probe", "runs")
CONFIG_MAP = "devbox-autoscaler"  # in the namespace the autoscaler looks after
CONFIG_KEY = "autoscaler.toml"
# Every duration is finite and at most a year: NaN compares false with everything (a box
# never idles, a pass never releases) and a huge one overflows the clock arithmetic and
# time formatting into a crash. A pass at most every MIN_INTERVAL: never a busy loop.
MAX_DURATION = 366 * 86400.0
MIN_INTERVAL = 0.1
MAX_INTERVAL = 3600.0
# Percent of one core: a generous bound (1024 cores), finite so a comparison means something.
MAX_CPU_THRESHOLD = 102400.0
MAX_POOL_SIZE = 1000
# What the autoscaler does with a box its agent reports hung (devbox.hang): warn, then
# release it `hung_grace` after the hang began; or only report it (status "hung").
HUNG = ("release", "report")
# A release waits at most this long for the box's probed processes to save.
MAX_SAVE_TIMEOUT = saves.MAX_LIMIT


@dataclass(frozen=True, kw_only=True)
class PoolTarget:
    """Keep `size` unclaimed warm pods of this profile (with `gpus` GPUs instead of the
    profile's own count, when given)."""

    profile: str
    gpus: int | None
    size: int


@dataclass(frozen=True, kw_only=True)
class Settings:
    # Every enabled signal quiet this long: the box is idle and is released.
    idle_timeout: float = 3600.0
    # The user is warned this long before an idle (or too old) box is released.
    warning: float = 600.0
    # A box claimed less than this long ago is never released for idleness.
    grace: float = 900.0
    # Boxes are released (with a warning) this long after their claim; 0: no limit.
    max_lifetime: float = 0.0
    # An agent silent this long is marked unhealthy (and reported) ...
    unhealthy_after: float = 120.0
    # ... and its box released once it has been silent this long (longer: a node hiccup
    # must not cost anyone their session).
    unhealthy_release_after: float = 3600.0
    max_releases_per_pass: int = 10
    # A GPU busier than this (mean utilisation, percent) is in use; so are the box's
    # processes above this CPU figure (percent of one core, the agent left out).
    gpu_util_threshold: float = 5.0
    cpu_threshold: float = 20.0
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    interval: float = 10.0  # seconds between reconcile passes
    metrics_port: int = 0  # Prometheus text exposition; 0: off
    metrics_address: str = "127.0.0.1"
    pools: tuple[PoolTarget, ...] = ()
    # A box its agent reports hung (busy GPUs at low power, no probe step, no input for
    # the hang rule's `after`): "release" warns and releases it `hung_grace` after the hang
    # began, whatever its GPU, CPU, runs and clients say; "report" only shows it.
    hung: str = "release"
    hung_grace: float = 7200.0
    # How long a release waits for the box's probed processes to save (0: it does not wait).
    save_timeout: float = 120.0


_DURATIONS = (
    "idle_timeout",
    "warning",
    "grace",
    "max_lifetime",
    "unhealthy_after",
    "unhealthy_release_after",
    "interval",
    "hung_grace",
    "save_timeout",
)


def duration(value: object, what: str) -> float:
    """Seconds, from a number or a string with a unit ("90s", "30m", "4h", "1d")."""
    seconds = units.seconds(value)
    if seconds is None:
        raise UsageError(f"{what} must be a duration (seconds, or 30m, 4h), not {value!r}")
    if not math.isfinite(seconds):  # nan, inf, and 1e309 (which TOML reads as inf)
        raise UsageError(f"{what} must be a finite duration, not {value!r}")
    return seconds


def parse(text: str, *, source: str, cluster: str = "") -> Settings:
    """Settings from TOML text; `source` names where it came from in every error.

    One document may serve several clusters: a `[clusters.NAME]` table holds what differs
    in cluster NAME (its pools, its thresholds), over the top-level settings. Every
    cluster's table is checked, whichever `cluster` (empty: none) is asked for."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"autoscaler config {source} is not valid TOML: {exc}") from None
    try:
        per_cluster = data.pop("clusters", {})
        if not isinstance(per_cluster, dict) or not all(
            isinstance(v, dict) for v in per_cluster.values()
        ):
            raise UsageError("clusters must be tables, as [clusters.NAME]")
        base = _settings(data)
        chosen = base
        for name, own in per_cluster.items():
            try:
                here = _settings({**data, **own})
            except UsageError as exc:
                raise UsageError(f"[clusters.{name}]: {exc.message}") from None
            if name == cluster:
                chosen = here
        return chosen
    except UsageError as exc:
        raise UsageError(f"autoscaler config {source}: {exc.message}") from None


def _settings(data: dict[str, Any]) -> Settings:
    known = {f.name for f in fields(Settings)} - {"pools"} | {"pool"}
    for key in data:
        if key not in known:
            raise UsageError(f"unknown setting {key!r}")
    values: dict[str, Any] = {}
    for key in _DURATIONS:
        if key in data:
            values[key] = duration(data[key], key)
    for key in ("gpu_util_threshold", "cpu_threshold"):
        if key in data:
            values[key] = _number(data[key], key)
    for key in ("max_releases_per_pass", "metrics_port"):
        if key in data:
            values[key] = _whole(data[key], key)
    if "metrics_address" in data:
        if not isinstance(data["metrics_address"], str) or not data["metrics_address"]:
            raise UsageError("metrics_address must be a host address string")
        values["metrics_address"] = data["metrics_address"]
    if "signals" in data:
        signals = data["signals"]
        if not isinstance(signals, list) or not signals or not all(s in SIGNALS for s in signals):
            raise UsageError(f"signals must be a non-empty list of {', '.join(SIGNALS)}")
        values["signals"] = tuple(dict.fromkeys(signals))
    if "hung" in data:
        if data["hung"] not in HUNG:
            raise UsageError(f'hung must be "release" or "report", not {data["hung"]!r}')
        values["hung"] = data["hung"]
    if "pool" in data:
        values["pools"] = _pools(data["pool"])
    settings = Settings(**values)
    _check(settings)
    return settings


def _check(s: Settings) -> None:
    for key in _DURATIONS:
        value = getattr(s, key)
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{key} must be a duration of at least 0 (got {value:g})")
        if value == 0 and key not in ("grace", "max_lifetime", "save_timeout"):
            raise UsageError(f"{key} must be above 0 (got {value:g})")
        if value > MAX_DURATION:
            raise UsageError(f"{key} must be at most 366d (got {value:g}s)")
    if not MIN_INTERVAL <= s.interval <= MAX_INTERVAL:
        raise UsageError(
            f"interval must be between {MIN_INTERVAL:g}s and {MAX_INTERVAL:g}s "
            f"(got {s.interval:g}s)"
        )
    if s.warning >= s.idle_timeout:
        raise UsageError(
            f"warning ({s.warning:g}s) must be shorter than idle_timeout ({s.idle_timeout:g}s)"
        )
    if s.max_lifetime and s.max_lifetime <= s.warning:
        raise UsageError(f"max_lifetime must be 0 (none) or longer than warning ({s.warning:g}s)")
    if s.hung_grace <= s.warning:
        raise UsageError(
            f"hung_grace ({s.hung_grace:g}s) must be longer than warning ({s.warning:g}s)"
        )
    if s.save_timeout > MAX_SAVE_TIMEOUT:
        raise UsageError(f"save_timeout must be at most 1h (got {s.save_timeout:g}s)")
    if s.unhealthy_release_after <= s.unhealthy_after:
        raise UsageError("unhealthy_release_after must be longer than unhealthy_after")
    if s.max_releases_per_pass < 1:
        raise UsageError("max_releases_per_pass must be at least 1")
    if not 0 <= s.gpu_util_threshold <= 100:  # false for nan too
        raise UsageError(
            "gpu_util_threshold must be a percentage between 0 and 100 "
            f"(got {s.gpu_util_threshold:g})"
        )
    if not 0 <= s.cpu_threshold <= MAX_CPU_THRESHOLD:
        raise UsageError(
            f"cpu_threshold must be between 0 and {MAX_CPU_THRESHOLD:g} (percent of one core; "
            f"got {s.cpu_threshold:g})"
        )
    if not 0 <= s.metrics_port <= 65535:
        raise UsageError("metrics_port must be between 0 (off) and 65535")


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"{what} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise UsageError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} must be a whole number, not {value!r}")
    return value


def _pools(raw: object) -> tuple[PoolTarget, ...]:
    if not isinstance(raw, list):
        raise UsageError("pool must be a list of tables ([[pool]] profile, gpus, size)")
    out: dict[tuple[str, int | None], PoolTarget] = {}
    for entry in raw:
        if not isinstance(entry, dict) or set(entry) - {"profile", "gpus", "size"}:
            raise UsageError("each [[pool]] has only profile, gpus and size")
        profile = entry.get("profile", "default")
        check_name(profile, "pool profile")
        gpus = _whole(entry["gpus"], "pool gpus") if "gpus" in entry else None
        size = _whole(entry.get("size"), "pool size")
        if (gpus is not None and gpus < 0) or size < 0:
            raise UsageError("pool gpus and size must be at least 0")
        if size > MAX_POOL_SIZE:
            raise UsageError(f"pool size must be at most {MAX_POOL_SIZE} (got {size})")
        if (profile, gpus) in out:
            with_gpus = "its own GPU count" if gpus is None else f"{gpus} GPU(s)"
            raise UsageError(f"pool {profile!r} with {with_gpus} is listed twice")
        out[(profile, gpus)] = PoolTarget(profile=profile, gpus=gpus, size=size)
    return tuple(out.values())
