"""Issue 16: every duration, rate and threshold of the autoscaler is finite and in range.
NaN compares false with everything (no box ever idles, no pass releases), infinity
overflows the clock arithmetic, and a zero interval is a busy loop; each is one clear line
naming the key and the value, through `parse` and through the real `devbox autoscaler`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devbox.autoscaler import policy
from devbox.autoscaler.config import Settings, parse
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.state import State
from devbox.autoscaler.world import Snapshot
from devbox.errors import UsageError

DURATIONS = (
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
THRESHOLDS = ("gpu_util_threshold", "cpu_threshold")
# As TOML values: nan, inf and -inf are TOML floats; 1e309 is one TOML reads as inf.
BAD_NUMBERS = ("nan", "inf", "-inf", "+inf", "-1", "1e309", "-1e309")
BAD_STRINGS = ('"nans"', '"nanm"', '"infh"', '"-infd"', '"1e309s"', '"-5s"', '"1e300d"')


def _rejected(text: str) -> str:
    with pytest.raises(UsageError) as caught:
        parse(text, source="/etc/a.toml")
    message = caught.value.message
    assert message.startswith("autoscaler config /etc/a.toml: ") and "\n" not in message
    return message


@pytest.mark.parametrize("key", DURATIONS + THRESHOLDS)
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_a_non_finite_or_negative_number_is_refused_by_name(key: str, value: str) -> None:
    message = _rejected(f"{key} = {value}")
    assert key in message
    shown = {"1e309": "inf", "-1e309": "-inf", "+inf": "inf"}.get(value, value)
    assert shown in message, message


@pytest.mark.parametrize("key", DURATIONS)
@pytest.mark.parametrize("value", BAD_STRINGS)
def test_a_non_finite_or_negative_duration_string_is_refused_by_name(key: str, value: str) -> None:
    message = _rejected(f"{key} = {value}")
    assert key in message, message


@pytest.mark.parametrize("key", DURATIONS)
def test_a_duration_over_a_year_is_refused(key: str) -> None:
    assert "at most" in _rejected(f'{key} = "400d"')


@pytest.mark.parametrize("value", ["0", "0.001", "0.05", '"0s"', '"2h"'])
def test_an_interval_that_would_spin_or_never_come_is_refused(value: str) -> None:
    assert "interval" in _rejected(f"interval = {value}")


def test_edges_that_are_fine() -> None:
    s = parse(
        'interval = 0.1\ngrace = 0\nmax_lifetime = "366d"\ncpu_threshold = 800\n'
        "gpu_util_threshold = 0\n",
        source="x",
    )
    assert s.interval == 0.1 and s.max_lifetime == 366 * 86400 and s.cpu_threshold == 800
    assert parse('interval = "1h"', source="x").interval == 3600


def test_a_huge_warm_pool_is_refused() -> None:
    assert "pool size must be at most" in _rejected("[[pool]]\nsize = 1000000000")


class _World:
    def __init__(self) -> None:
        self.passes = 0

    def snapshot(self) -> Snapshot:
        self.passes += 1
        return Snapshot(facts=[])

    def apply(self, action: policy.Action) -> bool:
        return True

    def load_state(self) -> State:
        return State()

    def save_state(self, text: str) -> None:
        pass


@pytest.mark.parametrize("interval", [0.0, 1e-9, float("nan"), -5.0])
def test_the_loop_never_spins_on_a_zero_tiny_or_nan_interval(interval: float) -> None:
    # Settings made in code skip parse(): the loop itself paces the passes.
    world = _World()
    scaler = Autoscaler(world, Settings(interval=interval))
    stop = threading.Event()
    runner = threading.Thread(target=scaler.run, args=(stop,), daemon=True)
    runner.start()
    time.sleep(0.5)
    stop.set()
    runner.join(timeout=5)
    assert not runner.is_alive()
    assert 1 <= world.passes <= 10, world.passes


def test_the_loop_survives_an_infinite_interval() -> None:
    # Event.wait(inf) raises OverflowError: the loop would die after its first pass.
    world = _World()
    scaler = Autoscaler(world, Settings(interval=float("inf")))
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            scaler.run(stop)
        except BaseException as exc:  # what the test looks for
            failed.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    time.sleep(0.3)
    assert runner.is_alive() and not failed, failed
    stop.set()
    runner.join(timeout=5)
    assert world.passes == 1


def _devbox(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "DEVBOX_BACKEND": "local",
    }
    env.pop("DEVBOX_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "devbox", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("setting", "shown"),
    [
        ("idle_timeout = nan", "nan"),
        ("interval = inf", "inf"),
        ("grace = -inf", "-inf"),
        ("interval = 0", "interval"),
        ("cpu_threshold = nan", "nan"),
        ('unhealthy_after = "1e309s"', "1e309s"),
    ],
)
@pytest.mark.parametrize("command", ["autoscaler", "explain"])
def test_the_real_cli_refuses_a_bad_value_in_one_line(
    tmp_path: Path, setting: str, shown: str, command: str
) -> None:
    config = tmp_path / "autoscaler.toml"
    config.write_text(setting + "\n")
    argv = ["autoscaler", "--once"] if command == "autoscaler" else ["explain", "somebox"]
    done = _devbox(tmp_path, *argv, "--config", str(config))
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    key = setting.split(" = ")[0]
    assert lines[0].startswith(f"devbox: error: autoscaler config {config}: ")
    assert key in lines[0] and shown in lines[0], lines[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e309", "-1", "0"])
def test_the_user_config_start_timeout_is_finite_and_named(tmp_path: Path, value: str) -> None:
    from devbox import config as user_config

    path = tmp_path / "config.toml"
    path.write_text(f"start_timeout = {value}\n")
    with pytest.raises(UsageError) as caught:
        user_config.load(path)
    message = caught.value.message
    shown = "inf" if value == "1e309" else value
    assert "start_timeout" in message and f"(got {shown})" in message, message
