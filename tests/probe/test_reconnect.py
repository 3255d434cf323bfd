"""devbox.probe across the agent's life and the training processes' lives: a training
process finds an agent restarted under it, a one-shot `devbox probe` shows the step
training is at now (never a report cached since the last watcher left), and the alerts of
a finished process give way to the healthy run after it. Real torch, real local boxes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devbox import protocol
from devbox.backends.local import LocalBackend
from devbox.config import Config
from devbox.ssh import known_hosts
from tests.conftest import User
from tests.probe import require_torch
from tests.probe.test_probe_e2e import _first_report, _until, trainers  # noqa: F401
from tests.tui.test_real_boxes import as_user  # noqa: F401  (a fixture)
from tui.feed import ModelView


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


def _restart_agent(name: str, restarted: list[subprocess.Popen[bytes]]) -> None:
    """Kill the box's agent (-9: it cleans nothing up) and start a new `devbox agent` on
    the same box home, as the launcher does; the box's record then names the new one. (A
    new keeper cannot start while the box's processes, the training one, live.)"""
    backend = LocalBackend(config=Config())
    box = backend.store.read(name)
    os.kill(int(box.extra["pid"]), signal.SIGKILL)
    _until(lambda: not backend.store.agent_alive(name), what="the agent's end")
    folder = backend.store.box_dir(name)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "devbox", "agent", "--name", name,
            "--home", str(folder / "home"), "--authorized-key", str(folder / "authorized_key"),
            "--host-key", str(folder / "host_key.2"), "--port", "0", "--gpus", "0",
            "--lock-file", str(folder / "agent.lock"), "--alerts-file", str(folder / "alerts.json"),
            "--multiplexer", "none", "--ready-fd", str(write_fd)]  # fmt: skip
    with (folder / "agent.2.log").open("ab") as log:
        restarted.append(
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready_pipe:
        ready = protocol.decode(ready_pipe.readline())
    assert ready.type == protocol.READY, ready
    backend.store.write(
        dataclasses.replace(
            box,
            port=int(ready.body["port"]),
            host_key=str(ready.body["host_key"]),
            host_key_fingerprint=str(ready.body["host_key_fingerprint"]),
            extra={**box.extra, "pid": str(ready.body["pid"])},
        )
    )
    known_hosts.pin(name, str(ready.body["host_key"]))


@pytest.fixture
def restarted() -> Iterator[list[subprocess.Popen[bytes]]]:
    agents: list[subprocess.Popen[bytes]] = []
    yield agents
    for agent in agents:
        agent.kill()
        agent.wait()


def test_training_reconnects_to_a_restarted_agent(
    as_user: User,  # noqa: F811
    trainers: Any,  # noqa: F811
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    as_user.up("phoenix", "--gpus", "0")
    trainer = trainers("phoenix", "--every", "1")
    assert _first_report(as_user, "phoenix")["pid"] == trainer.pid
    pointer = as_user.box_dir("phoenix") / "home" / protocol.PROBE_POINTER_FILE
    killed_agents_folder = Path(pointer.read_text().strip()).parent
    _restart_agent("phoenix", restarted)
    done = len(trainer.steps())
    # The same process, never restarted, reports to the new agent.
    report = _first_report(as_user, "phoenix")
    assert report["pid"] == trainer.pid and report["step"] >= done
    assert trainer.alive()
    # The killed agent could not remove its socket's folder: the new one did, as it
    # started its own probe hub (done before the report above came through it).
    assert not killed_agents_folder.exists()


def test_a_one_shot_report_is_of_now_not_cached(user: User, trainers: Any) -> None:  # noqa: F811
    user.up("fresh")
    trainer = trainers("fresh", "--every", "1")
    first = _first_report(user, "fresh")
    # Nobody watches for a while; training goes on.
    _until(lambda: len(trainer.steps()) > first["step"] + 40, what="steps after the report")
    done = max(trainer.steps())
    second = _first_report(user, "fresh")
    assert second["watched"] and second["step"] >= done, (first["step"], done, second["step"])


def _ls_alerts(user: User) -> str:
    (box,) = json.loads(user.devbox("ls", "--json", check=True).stdout)
    return str(box["alerts"])


def test_alerts_of_a_finished_run_give_way_to_the_next(user: User, trainers: Any) -> None:  # noqa: F811
    user.up("rerun")
    poisoned = trainers("rerun", "--every", "1", "--nan-at", "5", "--steps", "30")
    _until(lambda: _ls_alerts(user).startswith("nan"), what="the NaN alert in devbox ls")
    _until(lambda: len(poisoned.steps()) == 30, what="the poisoned run's end")
    healthy = trainers("rerun", "--every", "1")
    report = _first_report(user, "rerun", "--pid", str(healthy.pid))
    assert report["alerts"] == []
    _until(lambda: _ls_alerts(user) == "", timeout=30, what="the old run's alerts to go")
    (row,) = user.devbox("ls", check=True).stdout.decode().splitlines()[1:]
    assert row.split()[-1] == "-"
    # The process still running keeps its alerts: only a finished one's give way.
    hello = protocol.Frame(protocol.HELLO, {"processes": [{"pid": 1}, {"pid": 2}], "alerts": []})
    model = ModelView()
    model.add(hello)
    nan = {"kind": "nan", "layer": "fc", "step": 3, "message": "NaN"}

    def heartbeat(pid: int, *alerts: object) -> protocol.Frame:
        # As devbox.probe sends one while nobody watches: alerts only, no layers.
        body = {"pid": pid, "step": 3, "t": 0.0, "watched": False, "layers": []}
        return protocol.Frame(protocol.PROBE_STATS, {**body, "alerts": list(alerts)})

    model.add(heartbeat(1, nan))
    model.add(heartbeat(2))
    assert [a["pid"] for a in model.alerts] == [1]
    model.add(protocol.Frame(protocol.PROBE_GONE, {"pid": 1}))
    model.add(heartbeat(2))
    assert model.alerts == []
