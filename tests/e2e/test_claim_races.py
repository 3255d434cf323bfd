"""A claim interrupted at any moment, or racing a `down` or a `keep` of its name, leaves
either no box (and its GPU free) or a box that `ls` shows and `down` removes (issue 16).

Real `devbox` processes, interrupted as a terminal does (SIGINT to the process group), at
milestones the claim leaves on disk and, between them, after a sweep of delays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from devbox.backends.local import LocalBackend
from devbox.config import Config
from devbox.locks import lock_held
from tests.conftest import User
from tests.e2e.helpers import gpu_held, listed_boxes, one_gpu, start_devbox


def _milestone(user: User, name: str, what: str) -> Callable[[], bool]:
    folder = user.box_dir(name)
    return {
        "record": lambda: (folder / "box.json").exists(),
        "log": lambda: (folder / "agent.log").exists(),
        "keeper": lambda: lock_held(folder / "keeper.lock"),
        "agent": lambda: lock_held(folder / "agent.lock"),
        "host key": lambda: (folder / "host_key").exists(),
    }[what]


def _wait_or_exit(proc: subprocess.Popen[bytes], check: Callable[[], bool]) -> None:
    """Until `check` holds or the command has ended (the moment passed: a later one)."""
    deadline = time.monotonic() + 20
    while not check() and proc.poll() is None:
        assert time.monotonic() < deadline, "the claim never reached the moment"
        time.sleep(0.001)


def _box_or_nothing(user: User, name: str, gpu: str) -> str:
    """The invariant after a command ended: a box `ls` shows and `down` removes, or none;
    either way the GPU is free once no box holds it. Which of the two it was."""
    if name in listed_boxes(user):
        down = user.devbox("down", name)
        assert down.returncode == 0, down.stderr
        assert name not in listed_boxes(user)
        outcome = "box"
    else:
        outcome = "nothing"
    assert not gpu_held(user, gpu), f"{outcome} is left, but the GPU is still held"
    assert not lock_held(user.box_dir(name) / "keeper.lock"), "a process of the box lives"
    return outcome


# --- defect 3: an interrupt or a bad value at any point -----------------------------------

MOMENTS: list[str | float] = ["record", "log", "keeper", "agent", "host key"]
MOMENTS += [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6]


def test_ctrl_c_at_any_moment_of_up_leaves_a_box_or_nothing(user: User) -> None:
    gpu = one_gpu(user)
    outcomes, codes = [], []
    for moment in MOMENTS:
        up = start_devbox(
            user, "up", "job", "--gpus", "1", "--no-attach", "--json", foreground_job=True
        )
        if isinstance(moment, str):
            _wait_or_exit(up, _milestone(user, "job", moment))
        else:
            time.sleep(moment)  # between the milestones: a sweep of delays
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
        up.communicate(timeout=60)
        codes.append(up.returncode)
        outcomes.append(_box_or_nothing(user, "job", gpu))
    # The sweep did interrupt claims (130: ended by ctrl-c), and some of them mid-way.
    assert 130 in codes and "nothing" in outcomes, (codes, outcomes)
    # The name is not blocked by anything an interrupt left.
    assert user.up("job", "--gpus", "1")["gpu_ids"] == [gpu]


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "0", "1e400"])
def test_a_bad_timeout_is_one_line_and_starts_nothing(user: User, value: str) -> None:
    gpu = one_gpu(user)
    for args in (("up", "job", "--gpus", "1", "--no-attach"), ("pool", "warm")):
        result = user.devbox(*args, f"--timeout={value}")
        err = result.stderr.decode()
        assert result.returncode == 2, err
        assert err.startswith("devbox: error: ") and err.count("\n") == 1, err
        assert "timeout" in err and "Traceback" not in err
    assert not user.box_dir("job").exists()
    assert not gpu_held(user, gpu)


@pytest.mark.parametrize("value", ["nanm", "infh", "-1h", "0m", "1e400s"])
def test_a_bad_keep_duration_is_one_line(user: User, value: str) -> None:
    user.up("kept")
    result = user.devbox("keep", "kept", f"--for={value}")
    err = result.stderr.decode()
    assert result.returncode == 2 and err.count("\n") == 1 and "duration" in err, err
    assert listed_boxes(user)["kept"]["keep_until"] == 0


@pytest.mark.parametrize(
    "args", [("stats", "x", "--rate", "nan"), ("probe", "x", "--timeout", "nan")]
)
def test_other_nan_values_are_refused(user: User, args: tuple[str, ...]) -> None:
    result = user.devbox(*args)
    assert result.returncode == 2 and result.stderr.count(b"\n") == 1, result.stderr


# --- defect 4: operations on one name are serialised --------------------------------------


def test_up_and_down_of_one_name_racing_always_agree(user: User) -> None:
    gpu = one_gpu(user)
    starts: list[str | None] = [None, "record", "keeper", "agent", "host key"] * 2
    for when in starts:
        up = start_devbox(
            user, "up", "race", "--gpus", "1", "--no-attach", "--json", foreground_job=True
        )
        if when is not None:
            _wait_or_exit(up, _milestone(user, "race", when))
        down = start_devbox(user, "down", "race", foreground_job=True)
        up_out, up_err = up.communicate(timeout=60)
        _, down_err = down.communicate(timeout=60)
        assert up.returncode == 0, up_err  # one free GPU, one claim: it comes up
        assert json.loads(up_out)["gpu_ids"] == [gpu]
        boxes = listed_boxes(user)
        if down.returncode == 0:  # down came after the claim, and ended its box
            assert b"box race released" in down_err
            assert "race" not in boxes, f"down said released, yet the box is there ({when})"
            assert not gpu_held(user, gpu), f"down said released, yet the GPU is held ({when})"
        else:  # down came first, when there was no box yet; the box then came up
            assert down.returncode == 2 and b"no box named 'race'" in down_err, down_err
            assert boxes["race"]["state"] == "running" and gpu_held(user, gpu)
        _box_or_nothing(user, "race", gpu)


def test_a_keep_during_a_claim_is_kept(user: User) -> None:
    up = start_devbox(user, "up", "held", "--no-attach", "--json", foreground_job=True)
    _wait_or_exit(up, _milestone(user, "held", "record"))
    assert up.poll() is None, "the claim ended before the keep could race it"
    # In this process, so the keep is done within the claim (a `devbox keep` process would
    # spend the claim's length starting Python): it waits for the claim, which keeps it.
    backend = LocalBackend(config=Config(), root=user.state / "local")
    assert backend.keep("held", until=time.time() + 7200).keep_until > 0
    _, err = up.communicate(timeout=60)
    assert up.returncode == 0, err
    assert float(listed_boxes(user)["held"]["keep_until"]) > time.time() + 3600
