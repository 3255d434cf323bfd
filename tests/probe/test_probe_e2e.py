"""devbox.probe end to end: real torch (on the CPU) training a small model in a real local
box, the agent's probe hub, and `devbox probe` / `devbox ls` over the box's SSH connection."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, User
from tests.probe import require_torch
from tests.waiting import wait_until

TRAIN = REPO / "tests/probe/train.py"


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


class Trainer:
    def __init__(self, user: User, box: str, ref: Path, pid: int) -> None:
        self.user, self.box, self.ref, self.pid = user, box, ref, pid

    def steps(self) -> dict[int, dict[str, Any]]:
        lines = self.ref.read_text().splitlines() if self.ref.exists() else []
        rows = [json.loads(line) for line in lines if line.endswith("}")]
        return {r["step"]: r for r in rows}

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def trainers(user: User) -> Iterator[Any]:
    started: list[Trainer] = []

    def start(box: str, *args: str) -> Trainer:
        ref = user.home / f"ref-{len(started)}.jsonl"
        log = user.home / f"train-{len(started)}.log"
        command = f"{sys.executable} {TRAIN} --ref {ref} {' '.join(args)}"
        out = user.devbox(
            "ssh", box, "--", f"setsid {command} >{log} 2>&1 </dev/null & echo $!", check=True
        )
        trainer = Trainer(user, box, ref, int(out.stdout))
        started.append(trainer)
        return trainer

    yield start
    for t in started:
        if t.alive():
            os.kill(t.pid, signal.SIGKILL)


def _until(condition: Any, timeout: float = 60.0, what: str = "condition") -> Any:
    return wait_until(condition, timeout, what, every=0.2)


def _probe_json(user: User, box: str, *args: str) -> list[dict[str, Any]]:
    out = user.devbox("probe", box, "--json", *args, check=True, timeout=90).stdout
    return [json.loads(line) for line in out.splitlines()]


def _first_report(user: User, box: str, *args: str) -> dict[str, Any]:
    """The first report, once a training process (which takes seconds to import torch)
    has connected."""

    def attempt() -> dict[str, Any] | None:
        result = user.devbox("probe", box, "--json", *args, timeout=90)
        return json.loads(result.stdout.splitlines()[0]) if result.returncode == 0 else None

    report: dict[str, Any] = _until(attempt, what=f"a report from box {box}")
    return report


def _close(got: float | None, want: float | None) -> bool:
    if want is None or (isinstance(want, float) and not math.isfinite(want)):
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6)


def test_the_statistics_received_match_a_direct_computation(user: User, trainers: Any) -> None:
    user.up("train")
    first = trainers("train", "--every", "5")
    second = trainers("train", "--every", "3")
    _first_report(user, "train", "--pid", str(first.pid))
    _first_report(user, "train", "--pid", str(second.pid))
    frames = _probe_json(user, "train", "--watch", "--count", "6")
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for frame in frames:
        if frame["watched"]:
            by_pid.setdefault(frame["pid"], []).append(frame)
    # Several training processes in one box, each with its own reports.
    assert set(by_pid) <= {first.pid, second.pid} and len(by_pid) == 2, by_pid.keys()
    for trainer, every in ((first, 5), (second, 3)):
        reports = by_pid[trainer.pid]
        ref = _until(
            lambda t=trainer, r=reports: all(f["step"] in t.steps() for f in r) and t.steps(),
            what="reference steps",
        )
        for report in reports:
            assert report["step"] % every == 0
            want = ref[report["step"]]["layers"]
            assert [s["name"] for s in report["layers"]] == list(want)
            for stats in report["layers"]:
                expected = want[stats["name"]]
                for key, value in expected.items():
                    if key == "act_nan":
                        assert stats[key] == value
                    else:
                        assert _close(stats[key], value), (report["step"], stats["name"], key)
            # The ReLU's output has zeros; no layer is dead or NaN in a healthy run.
            assert report["layers"][1]["act_zeros"] > 0 and report["alerts"] == []

    text = user.devbox("probe", "train", "--pid", str(first.pid), check=True).stdout.decode()
    assert f"pid {first.pid}" in text and "GRAD NORM" in text and "UPDATE/W" in text
    assert "train.py" in text and "[torch]" in text  # the command, and what the probe hooks
    assert "\n0 " in text or "\n0  " in text  # the first layer's row
    (row,) = [r for r in user.devbox("ls", check=True).stdout.decode().splitlines()[1:]]
    assert row.split()[-1] == "-"  # no alerts


def test_an_injected_nan_raises_the_alert_within_one_step(user: User, trainers: Any) -> None:
    user.up("nan")
    # A watcher is attached before the NaN comes: the per-step check runs.
    watch = subprocess.Popen(
        [sys.executable, "-m", "devbox", "probe", "nan", "--json", "--watch"],
        env=user.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert watch.stdout is not None
        time.sleep(1.0)
        poisoned = trainers("nan", "--every", "10", "--nan-at", "23")
        alerts: list[dict[str, Any]] = []
        while not alerts:
            line = watch.stdout.readline()
            assert line, watch.stderr.read().decode() if watch.stderr else "stream ended"
            frame = json.loads(line)
            if frame["pid"] == poisoned.pid:
                alerts = frame["alerts"]
        assert alerts[0]["kind"] == "nan" and alerts[0]["step"] in (23, 24), alerts
    finally:
        watch.kill()
        watch.wait()
    ls = user.devbox("ls", check=True).stdout.decode().splitlines()
    assert ls[1].split()[-1].startswith("nan"), ls
    # The next report says which layer: the first one already outputs NaN.
    frames = _probe_json(user, "nan", "--pid", str(poisoned.pid))
    (report,) = frames
    assert report["layers"][0]["act_nan"] > 0 and report["layers"][0]["act_mean"] is None
    assert poisoned.alive()  # the probe never raises into training


def test_killing_the_agent_leaves_training_running(user: User, trainers: Any) -> None:
    box = user.up("doomed")
    trainer = trainers("doomed", "--every", "1")
    report = _first_report(user, "doomed")  # the link is up and reporting
    assert report["pid"] == trainer.pid
    agent = int(box["extra"]["pid"])
    os.kill(agent, signal.SIGKILL)
    done = len(trainer.steps())
    _until(lambda: len(trainer.steps()) > done + 20, what="training after the agent died")
    assert trainer.alive()
    log = (user.home / "train-0.log").read_text()
    assert "Traceback" not in log, log


def test_requests_are_answered_at_the_next_step(user: User, trainers: Any) -> None:
    user.up("ask")
    trainers("ask", "--every", "50")
    _first_report(user, "ask")
    (hist,) = _probe_json(user, "ask", "--histogram", "0", "--bins", "7")
    assert len(hist["counts"]) == 7 and sum(hist["counts"]) == 64 * 32
    assert hist["low"] < 0 < hist["high"]
    text = user.devbox("probe", "ask", "--histogram", "2", "--tensor", "gradient", check=True)
    assert b"histogram of the gradient of 2" in text.stdout
    (summary,) = _probe_json(user, "ask", "--summary", "4", "--tensor", "weight")
    assert summary["shape"] == [17] and summary["nan"] == 0 and summary["norm"] > 0
    (saved,) = _probe_json(user, "ask", "--save", "1")
    assert Path(saved["path"]).is_file() and saved["shape"] == [64, 32]


def test_bad_requests_get_one_line(user: User, trainers: Any) -> None:
    user.up("bad")
    empty = user.devbox("probe", "bad", timeout=60)
    assert empty.returncode == 1 and b"no training process in box bad" in empty.stderr
    trainers("bad", "--every", "5")
    _first_report(user, "bad")
    cases = [
        (("--histogram", "nope"), 2, b"no layer 'nope' is watched"),
        (("--bins", "5"), 2, b"--tensor and --bins go with"),
        (("--histogram", "0", "--bins", "0"), 2, b"bins must be at least 1"),
        (("--histogram", "0", "--watch"), 2, b"a request has one answer"),
        (("--summary", "0", "--bins", "3"), 2, b"--bins goes with --histogram"),
        (("--tensor", "bias", "--summary", "0"), 2, b"invalid choice: 'bias'"),
        (("--pid", "1"), 1, b"no probed process 1"),
        (("--pid", "x"), 2, b"pid must be a whole number"),
    ]
    for args, status, message in cases:
        result = user.devbox("probe", "bad", *args, timeout=60)
        assert result.returncode == status, (args, result.stderr)
        assert message in result.stderr and result.stderr.count(b"\n") == 1, result.stderr
    missing = user.devbox("probe", "nosuchbox")
    assert missing.returncode == 2 and b"no box named 'nosuchbox'" in missing.stderr


def test_stacks_of_a_stuck_process(user: User, trainers: Any) -> None:
    user.up("hung")
    nothing = user.devbox("probe", "hung", "--stacks", timeout=60)
    assert nothing.returncode == 1 and nothing.stderr.decode() == (
        "devbox: error: box hung has no probed process: stack dumps come from devbox.probe "
        "(probe.watch or probe.on_release) in the training code\n"
    )
    trainer = trainers("hung", "--every", "1", "--stuck-at", "5")
    _until(lambda: len(trainer.steps()) == 5, what="the stuck step")
    out = _until(
        lambda: (r := user.devbox("probe", "hung", "--stacks", timeout=60)).returncode == 0 and r,
        what="stacks",
    )
    text = out.stdout.decode()
    assert text.startswith(f"process {trainer.pid} (") and "in stuck_here" in text, text
    (answer,) = _probe_json(user, "hung", "--stacks", "--pid", str(trainer.pid))
    assert answer["pid"] == trainer.pid and "in stuck_here" in answer["stacks"]
