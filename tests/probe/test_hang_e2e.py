"""A hung job told from a busy one, and the save before release, end to end: real local
boxes and agents, simulated GPUs (the real NVML code reads them), a real torch training
loop with devbox.probe and probe.on_release, a real screen session in a real terminal,
`devbox ls`, `devbox probe --stacks`, `devbox down` and `devbox autoscaler`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import nvml_sim
from tests.conftest import PROMPT, REPO, User, ls_table
from tests.probe import require_torch
from tests.terminal import Terminal
from tests.waiting import wait_until

HANGS = REPO / "tests/probe/hangs.py"
DEVBOX = f"{sys.executable} -m devbox"
AFTER = 10  # [hang] after: above the probe's 5 s liveness beat, with room on a busy machine
LIMIT = 700_000  # mW: an H100's power limit
LOW, HIGH = 150_000, 560_000  # 21% and 80% of it


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


@dataclass
class Job:
    pid: int
    ckpt: Path
    hang_file: Path
    steps_file: Path

    def steps(self) -> int:
        try:
            return int(self.steps_file.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def jobs(user: User) -> Iterator[Any]:
    started: list[Job] = []

    def start(box: str, *extra: str) -> Job:
        n = len(started)
        job = Job(
            0,
            user.home / f"ckpt-{n}.pt",
            user.home / f"hang-{n}",
            user.home / f"steps-{n}",
        )
        command = (
            f"{sys.executable} {HANGS} --ckpt {job.ckpt} --hang-file {job.hang_file} "
            f"--steps-file {job.steps_file} {' '.join(extra)}"
        )
        log = user.home / f"job-{n}.log"
        out = user.devbox(
            "ssh", box, "--", f"setsid {command} >{log} 2>&1 </dev/null & echo $!", check=True
        )
        job.pid = int(out.stdout)
        started.append(job)
        wait_until(lambda: job.steps() >= 20, 90, f"job {n} training", every=0.2)
        return job

    yield start
    for job in started:
        if job.alive():
            os.kill(job.pid, signal.SIGKILL)


def _config(user: User, text: str) -> None:
    path = user.home / ".config/devbox/config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _gpu(user: User, power_mw: int) -> None:
    gpu = nvml_sim.SimGpu(util=100, power_mw=power_mw, power_limit_mw=LIMIT, mem_used=1 << 30)
    nvml_sim.write(user.gpu_file, [gpu])


def _activity(user: User, box: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads((user.box_dir(box) / "activity.json").read_text())
    except (OSError, ValueError):
        return {}
    return data


def _ls(user: User) -> tuple[dict[str, dict[str, str]], str]:
    result = user.devbox("ls", check=True)
    return ls_table(result.stdout.decode()), result.stderr.decode()


def test_a_stuck_loop_at_full_utilisation_and_low_power_is_hung_and_released_by_the_rule(
    user: User, term: Terminal, jobs: Any
) -> None:
    _config(user, f"save_timeout = 30\n[hang]\nutil = 90\npower = 30\nafter = {AFTER}\n")
    _gpu(user, LOW)
    user.up("h", "--gpus", "1")
    job = jobs("h")
    shell = term.start(f"{DEVBOX} ssh h")
    term.wait_for(shell, PROMPT)

    # 100% busy at 21% of its power, but the probe sees steps: busy, not hung. Asserted
    # once the GPU has looked stalled for twice the rule's `after`.
    def stalled_long() -> dict[str, Any] | None:
        a = _activity(user, "h")
        since = a.get("stalled_since") or 0
        return a if since and time.time() - since > 2 * AFTER else None

    busy = wait_until(stalled_long, 90, "a long stall with steps", every=0.5)
    assert busy["hung_since"] == 0 and busy["last_probe"] > busy["stalled_since"], busy
    table, _ = _ls(user)
    assert table["h"]["STATE"] == "running", table

    # The same GPU at 80% of its power: not even stalled.
    _gpu(user, HIGH)
    wait_until(lambda: _activity(user, "h").get("stalled_since") == 0, 30, "no stall")
    assert _activity(user, "h")["hung_since"] == 0

    # Now the loop stops stepping at low power: hung after `after`, said in `ls`, in the
    # attached session, and `devbox probe --stacks` shows where it waits.
    _gpu(user, LOW)
    job.hang_file.touch()
    # The session's message shows for a few seconds (screen's msgwait): watched from now.
    term.wait_for(shell, "box h looks hung", timeout=90)
    hung = _activity(user, "h")["hung_since"]
    assert hung and hung >= _activity(user, "h")["stalled_since"] + AFTER
    table, notes = _ls(user)
    assert table["h"]["STATE"] == "hung", table
    assert "h: hung for " in notes and "devbox probe h --stacks" in notes, notes
    assert json.loads(user.devbox("ls", "--json", check=True).stdout)[0]["hung_since"] == hung
    stacks = user.devbox("probe", "h", "--stacks", check=True, timeout=60).stdout.decode()
    assert f"process {job.pid}" in stacks and "stuck_here" in stacks, stacks

    # The autoscaler's rule: warned, then released after hung_grace; the GPU's 100% does
    # not keep it. The stuck job saves first (on the probe's thread: its own is stuck).
    settings = user.home / ".config/devbox/autoscaler.toml"
    settings.write_text(
        'idle_timeout = "1h"\nwarning = 4\ngrace = 0\ninterval = 0.5\nhung = "release"\n'
        "hung_grace = 8\nsave_timeout = 30\n"
    )
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
        term.wait_for(shell, "it will be released at", timeout=60)  # the rule's warning
        wait_until(lambda: not user.box_dir("h").joinpath("box.json").exists(), 90, "release")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    import torch

    saved = torch.load(job.ckpt, weights_only=True)
    assert saved["reason"] == "hung" and saved["step"] >= 20 and "0.weight" in saved["model"]
    assert not job.alive()
    text = log.read_text()
    assert "released box h" in text and "hung" in text, text
    explained = user.devbox("explain", "h", check=True).stdout.decode()
    assert "(hung)" in explained, explained


def test_down_waits_for_the_save_and_says_what_was_saved(user: User, jobs: Any) -> None:
    _config(user, "save_timeout = 60\n")
    user.up("s")
    job = jobs("s")
    result = user.devbox("down", "s", check=True, timeout=120)
    said = result.stdout.decode() + result.stderr.decode()
    assert f"process {job.pid}" in said and f"saved {job.ckpt}" in said, said
    import torch

    saved = torch.load(job.ckpt, weights_only=True)
    assert saved["reason"] == "down" and saved["step"] >= 20
    assert not job.alive()


def test_a_process_that_never_answers_is_released_after_the_limit(user: User, jobs: Any) -> None:
    _config(user, "save_timeout = 4\n")
    user.up("n")
    job = jobs("n", "--never-answer")
    started = time.monotonic()
    result = user.devbox("down", "n", check=True, timeout=120)
    waited = time.monotonic() - started
    said = result.stdout.decode() + result.stderr.decode()
    # Within what was left of the 4 s when the agent asked: a moment less.
    assert f"process {job.pid}" in said, said
    assert re.search(r"not saved: no answer within [34](\.\d)?s", said), said
    assert waited >= 4, waited  # it did wait for the answer that never came
    assert not job.ckpt.exists() and not job.alive()


def test_down_now_asks_nothing(user: User, jobs: Any) -> None:
    _config(user, "save_timeout = 60\n")
    user.up("q")
    job = jobs("q")
    result = user.devbox("down", "q", "--now", check=True, timeout=120)
    assert b"saved" not in result.stdout + result.stderr
    assert not job.ckpt.exists() and not job.alive()
    assert not user.box_dir("q").joinpath("box.json").exists()
