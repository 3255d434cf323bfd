"""Live telemetry end to end: a real agent sampling simulated GPUs (nvidia-ml-py's own
ctypes code against the project's NVML simulator) and the host through psutil, streamed
over the box's SSH connection to `devbox stats` and to the real OpenSSH client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import nvml_sim
from tests.conftest import User

GIB = 1 << 30


def _gpus(
    user: User,
    *,
    lost: int | None = None,
    unsupported: frozenset[str] = frozenset(),
    processes: tuple[nvml_sim.SimProcess, ...] = (),
) -> None:
    gpus = [
        nvml_sim.SimGpu(
            uuid=f"GPU-sim-{i:04d}",
            mem_used=(10 + i) * GIB,
            util=40 + i,
            mem_util=20 + i,
            power_mw=300_000 + 1000 * i,
            power_limit_mw=700_000,
            temp=60 + i,
            sm_clock=1980,
            unsupported=unsupported,
            lost=i == lost,
        )
        for i in range(2)
    ]
    nvml_sim.write(user.gpu_file, gpus, processes)


def _stats(user: User, name: str, *args: str) -> list[dict[str, Any]]:
    out = user.devbox("stats", name, "--json", *args, check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines()]


def _in_box(user: User, name: str, command: str) -> int:
    """Start `command` in the box, detached from the ssh channel; its pid."""
    out = user.devbox(
        "ssh", name, "--", f"setsid {command} >/dev/null 2>&1 < /dev/null & echo $!", check=True
    )
    return int(out.stdout)


def test_a_snapshot_shows_the_boxs_gpus_host_and_processes(user: User) -> None:
    _gpus(user)
    box = user.up("tele", "--gpus", "1")
    pid = _in_box(user, "tele", "sleep 300")
    # The sleep holds GPU memory on the box's GPU, in NVML's view.
    _gpus(user, processes=(nvml_sim.SimProcess(gpu=0, pid=pid, mem=3 * GIB, sm=55, ts=1),))
    deadline = time.monotonic() + 15
    while True:
        (sample,) = _stats(user, "tele")
        procs = {p["pid"]: p for p in sample["processes"]}
        if pid in procs and sample["gpus"][0]["processes"]:
            break
        assert time.monotonic() < deadline, f"sleep {pid} never showed: {sample}"
        time.sleep(0.3)
    (gpu,) = sample["gpus"]
    # Only the GPU this box claimed, with what the simulated driver reports.
    assert gpu["uuid"] == box["gpu_ids"][0]
    assert (gpu["util"], gpu["mem_util"], gpu["temp_c"], gpu["sm_clock_mhz"]) == (40, 20, 60, 1980)
    assert (gpu["mem_used"], gpu["mem_total"]) == (10 * GIB, 80 * GIB)
    assert (gpu["power_w"], gpu["power_limit_w"]) == (300.0, 700.0)
    (held,) = gpu["processes"]
    assert held["pid"] == held["box_pid"] == pid and held["mem_used"] == 3 * GIB
    assert procs[pid]["cmdline"] == "sleep 300" and procs[pid]["rss"] > 0
    host = sample["host"]
    assert len(host["cpu"]) == os.cpu_count()
    assert 0 < host["mem_used"] < host["mem_total"]
    # Only the box's processes: not this test runner.
    assert os.getpid() not in procs

    text = user.devbox("stats", "tele", check=True).stdout.decode()
    assert "Simulated H100" in text and "40%" in text and "300 / 700 W" in text
    assert "sleep 300" in text


def test_a_metric_the_gpu_does_not_report_is_missing_not_an_error(user: User) -> None:
    _gpus(user, unsupported=frozenset({"power", "temp"}))
    user.up("partial", "--gpus", "2")
    (sample,) = _stats(user, "partial")
    for gpu in sample["gpus"]:
        assert gpu["power_w"] is None and gpu["temp_c"] is None
        assert gpu["util"] is not None and gpu["mem_used"] is not None
    text = user.devbox("stats", "partial", check=True).stdout.decode()
    assert "- / 700 W" in text  # shown as missing, not as 0


@pytest.mark.parametrize("count", [0, 8])
def test_gpu_counts(user: User, count: int) -> None:
    nvml_sim.write(user.gpu_file, [nvml_sim.SimGpu(util=i) for i in range(count)])
    user.up("many", "--gpus", str(count))
    (sample,) = _stats(user, "many")
    assert [g["util"] for g in sample["gpus"]] == list(range(count))
    if count == 0:
        assert "no GPUs in this box" in user.devbox("stats", "many", check=True).stdout.decode()


# Starts `devbox stats ARGS...` (killed at the test's end).
Watcher = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def watcher(user: User) -> Iterator[Watcher]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, "-m", "devbox", "stats", *args],
            env=user.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _next(p: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, p.stderr.read().decode() if p.stderr else "stream ended"
    sample: dict[str, Any] = json.loads(line)
    return sample


def test_a_stream_at_10hz_survives_a_gpu_lost_mid_stream(user: User, watcher: Watcher) -> None:
    _gpus(user)
    user.up("stream", "--gpus", "2")
    p = watcher("stream", "--json", "--watch", "--rate", "10")
    first = [_next(p) for _ in range(10)]
    seqs = [s["seq"] for s in first]
    assert seqs == sorted(set(seqs))
    span = float(first[-1]["t"]) - float(first[0]["t"])
    assert span < 5.0  # 10 samples came at far more than the unwatched 1 Hz
    _gpus(user, lost=1)
    deadline = time.monotonic() + 10
    while True:
        sample = _next(p)
        gpus = sample["gpus"]
        if gpus[1]["lost"]:
            break
        assert time.monotonic() < deadline, "the lost GPU never showed as lost"
    assert gpus[1]["util"] is None and gpus[1]["mem_used"] is None
    assert gpus[0]["lost"] is False and gpus[0]["util"] == 40
    # And the stream goes on.
    assert int(_next(p)["seq"]) > int(sample["seq"])
    assert p.poll() is None


def test_count_and_history(user: User) -> None:
    user.gpus(1)
    user.up("hist", "--gpus", "1")
    time.sleep(2.5)  # the unwatched sampler keeps 1 Hz history from the start
    lines = _stats(user, "hist", "--history", "--count", "2", "--rate", "5")
    old = [s for s in lines if not s["processes"]]
    assert len(old) >= 2 and len(lines) == len(old) + 2
    assert [s["seq"] for s in lines] == sorted(s["seq"] for s in lines)
    assert all(g["processes"] == [] for s in old for g in s["gpus"])


def _subsystem(
    user: User, name: str, request: bytes, subsystem: str = "devbox-telemetry"
) -> subprocess.CompletedProcess[bytes]:
    return user.ssh("-s", f"{name}.devbox", subsystem, input=request, timeout=30)


def test_a_malformed_request_gets_an_error_frame_and_others_keep_streaming(
    user: User, watcher: Watcher
) -> None:
    user.gpus(1)
    user.up("robust", "--gpus", "1")
    p = watcher("robust", "--json", "--watch", "--rate", "5")
    before = int(_next(p)["seq"])
    bad = _subsystem(user, "robust", b'{"v":1,"type":"subscribe","rate":"often"}\n')
    assert bad.returncode == 1
    (frame,) = [json.loads(line) for line in bad.stdout.splitlines()]
    assert frame["type"] == "error" and "rate must be a number" in frame["message"]
    junk = _subsystem(user, "robust", b"\x00\xff not json\n")
    assert junk.returncode == 1 and b"not JSON" in junk.stdout
    nothing = _subsystem(user, "robust", b"bogus", subsystem="no-such-thing")
    assert nothing.returncode == 1 and b"no subsystem 'no-such-thing'" in nothing.stderr
    # The agent served the good subscriber throughout.
    assert int(_next(p)["seq"]) > before
    assert p.poll() is None


def test_a_good_request_over_plain_openssh(user: User) -> None:
    user.gpus(1)
    user.up("plain", "--gpus", "1")
    # One request, then EOF: the agent answers HELLO and at least one sample, then ends.
    out = _subsystem(user, "plain", b'{"v":1,"type":"subscribe","rate":20}\n')
    frames = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 0
    assert frames[0]["type"] == "hello" and frames[0]["box"] == "plain"


def test_watching_is_not_activity(user: User, watcher: Watcher) -> None:
    user.up("quiet")
    activity = user.box_dir("quiet") / "activity.json"
    user.devbox("ssh", "quiet", "--", "true", check=True)
    deadline = time.monotonic() + 5
    while not activity.exists() or json.loads(activity.read_text())["clients"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    last_input = json.loads(activity.read_text())["last_input"]
    p = watcher("quiet", "--json", "--watch", "--rate", "10")
    for _ in range(5):
        _next(p)
    state = json.loads(activity.read_text())
    assert (state["last_input"], state["clients"]) == (last_input, 0)


def test_bad_stats_input(user: User) -> None:
    result = user.devbox("stats", "nobox")
    assert result.returncode == 2 and result.stderr.count(b"\n") == 1
    assert b"devbox: error:" in result.stderr and b"Traceback" not in result.stderr
    for args in (
        ["--rate", "0"],
        ["--rate", "fast"],
        ["--rate", "100"],
        ["--count", "0"],
        ["--history"],
    ):
        result = user.devbox("stats", "x", *args)
        assert result.returncode == 2, args
        assert result.stderr.startswith(b"devbox: error:") and result.stderr.count(b"\n") == 1


def test_samples_carry_the_boxs_sessions(user: User) -> None:
    user.up("sessions")
    (idle,) = _stats(user, "sessions")
    assert idle["activity"]["clients"] == 0
    busy = subprocess.Popen(
        [sys.executable, "-m", "devbox", "ssh", "sessions", "--", "sleep", "5"],
        env=user.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while _stats(user, "sessions")[0]["activity"]["clients"] != 1:
            assert time.monotonic() < deadline, "the ssh session never showed"
            time.sleep(0.2)
    finally:
        busy.kill()
        busy.wait()
