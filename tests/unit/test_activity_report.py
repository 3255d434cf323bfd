"""The activity the agent reports for the autoscaler: the peak GPU and CPU figures of the
last telemetry window, through the local activity file and the Lease annotations."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agent.activity import Activity
from devbox import protocol
from devbox.backends.local.store import BoxStore


def _sample(t: float, utils: list[float | None], cpus: list[tuple[int, float | None]]) -> Any:
    return {
        "t": t,
        "seq": 1,
        "gpus": [{"util": u, "lost": False, "power_w": None, "power_limit_w": None} for u in utils],
        "host": {},
        "processes": [{"pid": pid, "cpu": cpu} for pid, cpu in cpus],
    }


def test_peaks_over_the_window_leave_the_agent_out(tmp_path: Path) -> None:
    folder = tmp_path / "boxes/b1"
    folder.mkdir(parents=True)
    activity = Activity(folder / "activity.json")
    me = os.getpid()
    activity.observe(_sample(100.0, [80.0, 20.0], [(me, 300.0), (42, 5.0)]))
    activity.observe(_sample(105.0, [0.0, None], [(me, 300.0), (42, 1.0), (43, 2.0)]))
    snap = activity.snapshot()
    assert snap["gpu_util"] == 50.0 and snap["cpu"] == 5.0  # the agent's own 300% left out
    # Past the window, only the newer figures count.
    activity.observe(_sample(100.0 + protocol.ACTIVITY_WINDOW + 1, [10.0], [(42, 0.5)]))
    snap = activity.snapshot()
    assert snap["gpu_util"] == 10.0 and snap["cpu"] == 3.0
    # No GPUs: no GPU figure, never a made-up zero.
    bare = Activity(None)
    bare.observe(_sample(1.0, [], [(42, 0.0)]))
    assert bare.snapshot()["gpu_util"] is None and bare.snapshot()["cpu"] == 0.0
    # The local backend reads the same figures back, with the file's age as heartbeat.
    activity.client(+1)
    report, written = BoxStore(tmp_path).activity_report("b1")
    assert report is not None and report["clients"] == 1 and report["gpu_util"] == 10.0
    assert written > 0
    (folder / "activity.json").write_text(json.dumps({"clients": "x"}))
    assert BoxStore(tmp_path).activity_report("b1") == (None, 0.0)


def test_lease_annotations_round_trip_and_bad_values() -> None:
    snap: protocol.Activity = {
        "last_input": 12.5,
        "clients": 2,
        "last_probe": 11.0,
        "runs": 1,
        "gpu_util": 93.25,
        "cpu": None,
        "last_forward": 13.0,
        "last_sftp": 0.0,
        "last_exec": 14.0,
        "stalled_since": 9.5,
        "hung_since": 0.0,
    }
    ann = protocol.activity_annotations(snap)
    assert protocol.ANN_CPU not in ann and ann[protocol.ANN_GPU_UTIL] == "93.2"
    back = protocol.activity_from_annotations(ann)
    assert back == {**snap, "gpu_util": 93.2}
    assert protocol.activity_from_annotations({}) is None
    assert protocol.activity_from_annotations({**ann, protocol.ANN_RUNS: "many"}) is None
    # An older agent's Lease (last input and clients only) still reads.
    old = protocol.activity_from_annotations(
        {protocol.ANN_LAST_INPUT: "5", protocol.ANN_CLIENTS: "0"}
    )
    assert old is not None and old["runs"] == 0 and old["gpu_util"] is None


def test_an_unchanged_record_is_only_touched_and_a_changed_or_lost_one_rewritten(
    tmp_path: Path,
) -> None:
    path = tmp_path / "activity.json"
    activity = Activity(path)
    activity.client(1)  # forced: written now
    first = path.stat()
    os.utime(path, (first.st_atime - 60, first.st_mtime - 60))  # as if a minute old
    activity.client(0)  # the same record again (no client is a change: 1 -> 1 + 0)
    again = path.stat()
    # The heartbeat (the file's age) is renewed in place: the same file, not a new one.
    assert again.st_ino == first.st_ino and again.st_mtime > first.st_mtime - 30
    activity.client(-1)
    changed = path.stat()
    assert changed.st_ino != first.st_ino and json.loads(path.read_text())["clients"] == 0
    path.unlink()  # gone (a purge, a cleaner): the next write makes it again
    activity.client(0)
    assert json.loads(path.read_text())["clients"] == 0
