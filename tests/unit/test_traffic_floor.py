"""The traffic floor: forwarded, SFTP and stdin bytes count as a person at work once
protocol.TRAFFIC_FLOOR of one kind arrive within one protocol.TRAFFIC_WINDOW, so that a
keepalive, or an editor left open and untouched, never holds a box's GPUs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.activity import Activity
from devbox import protocol

FLOOR, WINDOW = protocol.TRAFFIC_FLOOR, protocol.TRAFFIC_WINDOW


class Clock:
    """The monotonic clock the windows are measured on, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "monotonic", c)
    return c


def test_the_floor_within_one_window_counts(clock: Clock) -> None:
    activity = Activity(None)
    activity.traffic("forward", FLOOR - 1)
    clock.now += WINDOW - 1
    assert activity.snapshot()["last_forward"] == 0.0
    before = time.time()
    activity.traffic("forward", 1)
    assert activity.snapshot()["last_forward"] >= before
    # Past the floor, every further byte of the window keeps it current.
    first = activity.snapshot()["last_forward"]
    activity.traffic("forward", 1)
    assert activity.snapshot()["last_forward"] >= first


def test_a_trickle_over_many_windows_never_counts(clock: Clock) -> None:
    activity = Activity(None)
    # A keepalive-sized exchange every 15 s for an hour: far more than the floor in all.
    for _ in range(240):
        activity.traffic("forward", 100)
        clock.now += 15
    assert FLOOR < 240 * 100 and activity.snapshot()["last_forward"] == 0.0


def test_a_window_starts_again_after_it_ends(clock: Clock) -> None:
    activity = Activity(None)
    activity.traffic("forward", FLOOR - 1)
    clock.now += WINDOW
    activity.traffic("forward", 1)  # the first byte of a new window, not the last of the old
    assert activity.snapshot()["last_forward"] == 0.0
    clock.now += 1
    activity.traffic("forward", FLOOR - 1)  # with it, the floor of the new window
    assert activity.snapshot()["last_forward"] > 0.0


def test_kinds_have_floors_of_their_own(clock: Clock) -> None:
    activity = Activity(None)
    half = FLOOR // 2
    for kind in protocol.TRAFFIC_KINDS:
        activity.traffic(kind, half)
    snap = activity.snapshot()
    assert (snap["last_forward"], snap["last_sftp"], snap["last_exec"]) == (0.0, 0.0, 0.0)
    activity.traffic("sftp", FLOOR - half)
    snap = activity.snapshot()
    assert snap["last_sftp"] > 0.0 and snap["last_forward"] == snap["last_exec"] == 0.0


def test_one_large_write_counts_at_once(clock: Clock) -> None:
    activity = Activity(None)
    activity.traffic("exec", 10 * FLOOR)
    assert activity.snapshot()["last_exec"] > 0.0


def test_the_activity_file_reports_it(clock: Clock, tmp_path: Path) -> None:
    path = tmp_path / "activity.json"
    activity = Activity(path)
    activity.client(+1)  # written at once
    assert json.loads(path.read_text())["last_forward"] == 0.0
    clock.now += 2  # past the file's rewrite interval
    activity.traffic("forward", FLOOR)
    assert json.loads(path.read_text())["last_forward"] > 0.0
