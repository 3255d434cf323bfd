"""`devbox autoscaler` on the local backend: real agents, a real screen session attached
through a real terminal, simulated GPUs; short timeouts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tests import nvml_sim
from tests.conftest import PROMPT, User, ls_table
from tests.terminal import Terminal
from tests.waiting import wait_until

DEVBOX = f"{sys.executable} -m devbox"
SETTINGS = """
idle_timeout = 8
warning = 4
grace = 0
interval = 0.5
unhealthy_after = 20
unhealthy_release_after = 60
"""


def _ls(user: User) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in json.loads(user.devbox("ls", "--json", check=True).stdout)}


def _wait(what: str, check: Callable[[], object], timeout: float = 40) -> None:
    wait_until(check, timeout, what, every=0.2)


def test_idle_box_is_warned_in_its_session_then_released_while_training_goes_on(
    user: User, term: Terminal
) -> None:
    user.gpus(2)
    user.up("idle")
    user.up("train", "--gpus", "1")
    (user.box_dir("idle") / "home/notes.txt").write_text("mine\n")
    # A training loop nobody types at: its GPU is busy.
    nvml_sim.write(user.gpu_file, [nvml_sim.SimGpu(util=93), nvml_sim.SimGpu(util=93)])
    # An attached session with nobody typing is not use: it gets the warning.
    shell = term.start(f"{DEVBOX} ssh idle")
    term.wait_for(shell, PROMPT)
    config = user.home / ".config/devbox/autoscaler.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(SETTINGS)
    log = user.home / "autoscaler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "devbox", "autoscaler"],
            env=user.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        # From the autoscaler's start (seconds of imports on a loaded machine), idle + 4 s.
        term.wait_for(shell, "devbox: box idle has been idle", timeout=90)
        table = user.devbox("ls", check=True).stdout.decode()
        release = ls_table(table)["idle"]["RELEASE"]
        assert release.startswith("in ") and release.endswith("s"), table
        listed = _ls(user)["idle"]
        assert listed["release_reason"] == "idle" and float(listed["release_at"]) > time.time()
        _wait("the idle box's release", lambda: "idle" not in _ls(user))
        assert (user.box_dir("idle") / "home/notes.txt").read_text() == "mine\n"
        explained = user.devbox("explain", "idle", check=True).stdout.decode()
        assert "box idle was released at" in explained and "(idle)" in explained
        # Two idle timeouts later the training box is still there, never warned.
        time.sleep(10)
        train = _ls(user)["train"]
        assert train["state"] == "running" and train["release_at"] == 0
        why = user.devbox("explain", "train", check=True).stdout.decode()
        assert why.startswith("box train (") and ": busy: in use: GPU 93%" in why
        assert "gpu      active now" in why
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    text = log.read_text()
    assert "warned box idle" in text and "released box idle" in text, text
    assert "train" not in text.replace("explain", ""), text


def test_a_bad_setting_is_one_line_at_start(user: User) -> None:
    config = user.home / ".config/devbox/autoscaler.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('idle_timeout = "forever"\n')
    result = user.devbox("autoscaler", "--once")
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err.strip().splitlines() == [
        f"devbox: error: autoscaler config {config}: idle_timeout must be a duration "
        "(seconds, or 30m, 4h), not 'forever'"
    ]
    missing = user.devbox("autoscaler", "--config", str(user.home / "nope.toml"), "--once")
    assert missing.returncode == 2 and b"cannot read autoscaler config" in missing.stderr
    unknown = user.devbox("explain", "nobox", "--config", "/dev/null")
    assert unknown.returncode == 2
    assert unknown.stderr.decode().strip() == (
        "devbox: error: no box named 'nobox', and none released lately"
    )
