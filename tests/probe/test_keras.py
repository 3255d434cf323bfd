"""devbox.probe on Keras 3 end to end: model.fit on the JAX and the PyTorch backend (on the
CPU) in a real local box, the agent's probe hub, and `devbox probe` over SSH; what arrives
is compared with tests/probe/keras_train.py's direct numpy computation."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO, User
from tests.probe import require
from tests.waiting import wait_until

TRAIN = REPO / "tests/probe/keras_train.py"


def _start(user: User, box: str, n: int, *args: str) -> tuple[int, Path]:
    ref, log = user.home / f"ref-{n}.jsonl", user.home / f"train-{n}.log"
    command = f"env PYTHONPATH={REPO} {sys.executable} {TRAIN} --ref {ref} {' '.join(args)}"
    out = user.devbox(
        "ssh", box, "--", f"setsid {command} >{log} 2>&1 </dev/null & echo $!", check=True
    )
    return int(out.stdout), ref


def _steps(ref: Path) -> dict[int, dict[str, Any]]:
    lines = ref.read_text().splitlines() if ref.exists() else []
    return {r["step"]: r for r in (json.loads(line) for line in lines if line.endswith("}"))}


def _step(ref: Path, step: int) -> dict[str, Any] | None:
    return _steps(ref).get(step)


def _report(user: User, box: str, pid: int) -> dict[str, Any]:
    def attempt() -> dict[str, Any] | None:
        result = user.devbox("probe", box, "--json", "--pid", str(pid), timeout=90)
        return json.loads(result.stdout.splitlines()[0]) if result.returncode == 0 else None

    report: dict[str, Any] = wait_until(attempt, 90, f"a report from {pid}", every=0.3)
    return report


def _close(got: float | None, want: float | None) -> bool:
    if want is None or not math.isfinite(want):
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6)


def test_keras_statistics_received_match_a_direct_computation(user: User) -> None:
    require("keras", "jax")
    require("keras", "torch")
    user.up("keras")
    started = [
        (backend, every, *_start(user, "keras", n, "--backend", backend, "--every", str(every)))
        for n, (backend, every) in enumerate((("jax", 3), ("torch", 4)))
    ]
    try:
        for backend, every, pid, ref in started:
            report = _report(user, "keras", pid)
            assert report["watched"] and report["step"] % every == 0, report
            step = report["step"]
            found = functools.partial(_step, ref, step)
            want = wait_until(found, 30, "the reference step")["layers"]
            assert (
                [s["name"] for s in report["layers"]]
                == list(want)
                == [
                    "dense",
                    "dense_1",
                    "dense_2",
                ]
            )
            for stats in report["layers"]:
                for key, value in want[stats["name"]].items():
                    ok = stats[key] == value if key == "act_nan" else _close(stats[key], value)
                    assert ok, (backend, report["step"], stats["name"], key, stats[key], value)
            assert report["layers"][0]["act_zeros"] > 0 and report["alerts"] == []
            text = user.devbox("probe", "keras", "--pid", str(pid), check=True).stdout.decode()
            assert f"[keras/{backend}]" in text and "keras_train.py" in text, text
            assert "GRAD NORM" in text and "UPDATE/W" in text and "dense_1" in text
    finally:
        for _, _, pid, _ in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for n in range(len(started)):
        log = (user.home / f"train-{n}.log").read_text()
        assert "Traceback" not in log, log
