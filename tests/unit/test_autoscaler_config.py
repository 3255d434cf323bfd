"""The autoscaler's settings: durations, pools, and one clear line for every bad value."""

from __future__ import annotations

import pytest

from devbox.autoscaler.config import PoolTarget, Settings, parse
from devbox.errors import UsageError


def test_defaults_and_values() -> None:
    assert parse("", source="x") == Settings()
    s = parse(
        'idle_timeout = "2h"\nwarning = 300\ngrace = "0s"\nmax_lifetime = "1d"\n'
        'signals = ["input", "gpu"]\n'
        '[[pool]]\nprofile = "a100"\ngpus = 1\nsize = 2\n',
        source="x",
    )
    assert s.idle_timeout == 7200 and s.warning == 300 and s.grace == 0
    assert s.max_lifetime == 86400 and s.signals == ("input", "gpu")
    assert s.pools == (PoolTarget(profile="a100", gpus=1, size=2),)


def test_hang_and_save_settings() -> None:
    d = Settings()
    assert (d.hung, d.hung_grace, d.save_timeout) == ("release", 7200, 120)
    s = parse('hung = "report"\nhung_grace = "30m"\nsave_timeout = 0\n', source="x")
    assert (s.hung, s.hung_grace, s.save_timeout) == ("report", 1800, 0)
    assert parse('save_timeout = "1h"', source="x").save_timeout == 3600
    # Per cluster, as every other key.
    text = 'hung_grace = "3h"\n[clusters.a]\nhung = "report"\nsave_timeout = "5m"\n'
    a = parse(text, source="x", cluster="a")
    assert (a.hung, a.hung_grace, a.save_timeout) == ("report", 10800, 300)
    assert parse(text, source="x").hung == "release"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("idle_timout = 5", "unknown setting 'idle_timout'"),
        ('idle_timeout = "soon"', "idle_timeout must be a duration"),
        ("idle_timeout = true", "idle_timeout must be a duration"),
        ("idle_timeout = 0", "idle_timeout must be above 0"),
        ("warning = 4000", "warning (4000s) must be shorter than idle_timeout"),
        ("max_lifetime = 10", "max_lifetime must be 0 (none) or longer than warning"),
        ("unhealthy_after = 7200", "unhealthy_release_after must be longer"),
        ("max_releases_per_pass = 0", "max_releases_per_pass must be at least 1"),
        ("max_releases_per_pass = 1.5", "max_releases_per_pass must be a whole number"),
        ("gpu_util_threshold = 120", "gpu_util_threshold must be a percentage"),
        ('signals = ["input", "typing"]', "signals must be a non-empty list"),
        ("signals = []", "signals must be a non-empty list"),
        ("metrics_port = 70000", "metrics_port must be between 0"),
        ("[[pool]]\nsize = -1", "pool gpus and size must be at least 0"),
        ('[[pool]]\nprofile = "a b"\nsize = 1', "pool profile must be lowercase letters"),
        ("[[pool]]\nsize = 1\ncolour = 2", "each [[pool]] has only profile, gpus and size"),
        ("[[pool]]\nsize = 1\n[[pool]]\nsize = 2", "is listed twice"),
        ("pool = 3", "pool must be a list of tables"),
        ("idle_timeout = ", "is not valid TOML"),
        ('hung = "kill"', 'hung must be "release" or "report", not \'kill\''),
        ("hung = true", 'hung must be "release" or "report"'),
        ('hung_grace = "5m"', "hung_grace (300s) must be longer than warning (600s)"),
        ('hung_grace = "10m"', "hung_grace (600s) must be longer than warning"),
        ("hung_grace = 0", "hung_grace must be above 0"),
        ('hung_grace = "400d"', "hung_grace must be at most 366d"),
        ('hung_grace = "soon"', "hung_grace must be a duration"),
        ('save_timeout = "2h"', "save_timeout must be at most 1h (got 7200s)"),
        ('save_timeout = "-1s"', "save_timeout must be a duration of at least 0"),
        ("save_timeout = nan", "save_timeout must be a finite duration"),
        ('[clusters.a]\nhung = "off"', '[clusters.a]: hung must be "release" or "report"'),
    ],
)
def test_bad_values_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse(text, source="/etc/a.toml")
    assert caught.value.message.startswith("autoscaler config /etc/a.toml")
    assert message in caught.value.message and "\n" not in caught.value.message.strip()


def test_one_document_serves_several_clusters() -> None:
    text = (
        'idle_timeout = "2h"\nwarning = 300\n'
        '[[pool]]\nprofile = "a100"\nsize = 2\n'
        '[clusters.cloud]\nidle_timeout = "20m"\n'
        '[[clusters.cloud.pool]]\nprofile = "a100"\nsize = 0\n'
        "[clusters.onprem]\nmetrics_port = 9101\n"
    )
    base = parse(text, source="x")
    cloud = parse(text, source="x", cluster="cloud")
    onprem = parse(text, source="x", cluster="onprem")
    assert (base.idle_timeout, base.pools) == (
        7200,
        (PoolTarget(profile="a100", gpus=None, size=2),),
    )
    # A cluster's table replaces what it names; the rest is the document's.
    assert cloud.idle_timeout == 1200 and cloud.warning == 300
    assert cloud.pools == (PoolTarget(profile="a100", gpus=None, size=0),)
    assert (
        onprem.idle_timeout == 7200 and onprem.metrics_port == 9101 and onprem.pools == base.pools
    )
    assert parse(text, source="x", cluster="elsewhere") == base


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("clusters = 3", "clusters must be tables"),
        ("[clusters.a]\nidle_timout = 5", "[clusters.a]: unknown setting 'idle_timout'"),
        # Checked whichever cluster is asked for: a typo waits for no one.
        (
            'warning = 300\n[clusters.b]\nidle_timeout = "1m"',
            "[clusters.b]: warning (300s) must be",
        ),
        ("[clusters.a.clusters.b]\nwarning = 1", "[clusters.a]: unknown setting 'clusters'"),
    ],
)
def test_bad_cluster_tables_are_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        parse(text, source="x", cluster="a")
    assert message in raised.value.message
