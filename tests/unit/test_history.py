"""The telemetry history: the last `seconds` of entries, oldest first, kept compressed."""

from __future__ import annotations

import json

from agent.history import History


def _entry(i: int) -> bytes:
    gpus = [
        {"index": g, "util": 40.0 + g, "mem_used": 10 << 30, "power_w": 300.5} for g in range(8)
    ]
    return json.dumps({"seq": i, "t": 1000.0 + i, "gpus": gpus}, separators=(",", ":")).encode()


def test_entries_come_back_oldest_first_across_blocks() -> None:
    history = History(600, block=7)
    for i in range(100):
        history.add(float(i), _entry(i))
    got = [json.loads(e)["seq"] for e in history.entries(99.0)]
    assert got == list(range(100))


def test_only_the_last_seconds_are_kept_and_replayed() -> None:
    history = History(60, block=10)
    for i in range(300):
        history.add(float(i), _entry(i))
    got = [json.loads(e)["seq"] for e in history.entries(299.0)]
    assert got == list(range(239, 300))
    # Later, with nothing added (a quiet box's slow ticks): older ones drop out of the replay.
    assert [json.loads(e)["seq"] for e in history.entries(330.0)] == list(range(270, 300))


def test_what_is_kept_is_compressed() -> None:
    history = History(60, block=60)
    plain = 0
    for i in range(600):
        entry = _entry(i)
        plain += len(entry)
        history.add(float(i), entry)
    # Of ten minutes of entries, at most two (whole blocks) stay, at a fraction of their size.
    assert history.stored_bytes() < plain * 2 / 10 / 4
