"""Saving before a release, and stack dumps of a hung process: real training processes
(torch on the CPU, tests/probe/release_train.py) with devbox.probe, and the agent's real
ProbeHub on a socket of the test's own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from agent.probehub import ProbeHub
from devbox import protocol
from tests.conftest import REPO
from tests.probe import require_torch

TRAIN = REPO / "tests/probe/release_train.py"


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


@pytest.fixture
async def hub(short_tmp: Path) -> AsyncIterator[ProbeHub]:
    hub = ProbeHub(box="t", path=short_tmp / "hub" / "p.sock", on_batch=lambda: None)
    await hub.start()
    yield hub
    await hub.close()
    await _until(lambda: not hub.processes, "the links to close")  # no task left behind


class Trainer:
    def __init__(self, process: subprocess.Popen[bytes], out: Path) -> None:
        self.process, self.out = process, out
        self.pid = process.pid

    def steps(self) -> int:
        try:
            return int((self.out / "steps").read_text() or 0)
        except (OSError, ValueError):
            return 0

    @property
    def checkpoint(self) -> Path:
        return self.out / "ckpt.txt"


@pytest.fixture
def trainers(short_tmp: Path, tmp_path: Path) -> Iterator[Callable[[str], Trainer]]:
    started: list[Trainer] = []

    def start(mode: str) -> Trainer:
        out = tmp_path / f"{mode}-{len(started)}"
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != protocol.PROBE_POINTER_ENV}
        env.update(
            {
                protocol.PROBE_SOCKET_ENV: str(short_tmp / "hub" / "p.sock"),
                "HOME": str(tmp_path),
                "PYTHONPATH": str(REPO),
            }
        )
        log = (out / "log").open("wb")
        process = subprocess.Popen(
            [sys.executable, str(TRAIN), "--mode", mode, "--out", str(out)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started.append(Trainer(process, out))
        return started[-1]

    yield start
    for t in started:
        t.process.kill()
        t.process.wait()


async def _until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


def _links(hub: ProbeHub, pid: int, *, release: bool | None = None) -> list[Any]:
    return [
        link
        for link in hub.processes.values()
        if link.pid == pid and (release is None or link.release == release)
    ]


async def _ready(
    hub: ProbeHub, trainer: Trainer, *, release: bool = True, watch: bool = True
) -> None:
    """The process's links are up, and it has trained."""
    await _until(lambda: _links(hub, trainer.pid, release=True) or not release, "release link")
    await _until(lambda: _links(hub, trainer.pid, release=False) or not watch, "watch link")
    await _until(lambda: trainer.steps() >= 3, "steps")


async def test_a_training_process_saves_on_its_training_thread(
    hub: ProbeHub, trainers: Any
) -> None:
    trainer = trainers("step")
    await _ready(hub, trainer)
    (result,) = await hub.release(reason="idle for 2h", deadline=time.time() + 30)
    assert result["status"] == "saved", result
    assert result["pid"] == trainer.pid and "release_train.py" in result["cmd"]
    assert result["saved"] == [str(trainer.checkpoint)] and result["detail"] == ""
    # At a step boundary, on the thread that trains: the weights were whole.
    assert trainer.checkpoint.read_text() == "MainThread idle for 2h"
    # A second release gets the same answer, without saving again.
    trainer.checkpoint.unlink()
    (again,) = await hub.release(reason="again", deadline=time.time() + 30)
    assert again["status"] == "saved" and not trainer.checkpoint.exists()
    # A model's request goes to the process's Watcher, never to its release link.
    sub = _Subscriber(hub)
    for request_id in (1, 2):
        pid = {"pid": trainer.pid} if request_id == 2 else {}
        sub.ask(id=request_id, kind="summary", layer="0", tensor="weight", **pid)
        reply = await _until(partial(sub.reply, request_id), "the summary")
        assert reply["shape"] == [8 * 4 + 8] and "error" not in reply, reply  # weight, bias
    await sub.close()


async def test_an_idle_process_saves_on_a_thread_of_its_own(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("idle")
    await _ready(hub, trainer)
    await _until(lambda: trainer.steps() == 3, "the end of training")
    (result,) = await hub.release(reason="down", deadline=time.time() + 30)
    assert result["status"] == "saved", result
    assert trainer.checkpoint.read_text() == "devbox-probe-release down"


async def test_a_save_that_raises_fails_and_training_goes_on(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("raise")
    await _ready(hub, trainer)
    (result,) = await hub.release(reason="down", deadline=time.time() + 30)
    assert result["status"] == "failed" and result["saved"] == []
    assert result["detail"] == "OSError: disk full while saving for down"
    done = trainer.steps()
    await _until(lambda: trainer.steps() > done + 20, "steps after the failed save")
    assert trainer.process.poll() is None
    assert b"Traceback" not in (trainer.out / "log").read_bytes()


@pytest.mark.parametrize("mode", ["block", "poll-never"])
async def test_a_process_that_never_answers_times_out(
    hub: ProbeHub, trainers: Any, mode: str
) -> None:
    trainer = trainers(mode)
    await _ready(hub, trainer)
    started = time.monotonic()
    (result,) = await hub.release(reason="down", deadline=time.time() + 1.5)
    assert 1.0 < time.monotonic() - started < 10
    assert result == {
        "pid": trainer.pid,
        "cmd": result["cmd"],
        "status": "timeout",
        "saved": [],
        "detail": "no answer within 1.5s",
    }
    if mode == "poll-never":  # (a save that blocks on the training thread blocks it)
        done = trainer.steps()
        await _until(lambda: trainer.steps() > done + 5, "steps after the deadline")


async def test_a_polling_loop_answers_with_what_it_saved(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("poll")
    await _ready(hub, trainer, watch=False)  # no Watcher: the release link alone
    (result,) = await hub.release(reason="down", deadline=time.time() + 30)
    assert result["status"] == "saved" and result["saved"] == [str(trainer.checkpoint)]
    assert trainer.checkpoint.read_text() == "MainThread polled"
    # Asked about a model, its release link says at once that it watches none.
    sub = _Subscriber(hub)
    sub.ask(id=1, kind="summary", layer="0", tensor="weight", pid=trainer.pid)
    reply = await _until(lambda: sub.reply(1), "the answer")
    assert reply["error"] == f"process {trainer.pid} watches no model (only probe.on_release)"
    stacks = _Subscriber(hub)
    stacks.ask(id=1, kind="stacks", layer="", tensor="", pid=trainer.pid)
    assert "thread MainThread" in (await _until(lambda: stacks.reply(1), "stacks"))["stacks"]
    await sub.close()
    await stacks.close()


async def test_a_watch_only_process_has_no_handler(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("watch-only")
    await _ready(hub, trainer, release=False)
    (result,) = await hub.release(reason="down", deadline=time.time() + 30)
    assert result == {
        "pid": trainer.pid,
        "cmd": result["cmd"],
        "status": "no-handler",
        "saved": [],
        "detail": "probed, no probe.on_release",
    }
    # A deadline already passed asks nobody and returns at once.
    saver = trainers("step")
    await _ready(hub, saver)
    results = await hub.release(reason="late", deadline=time.time() - 1)
    assert [(r["pid"], r["status"]) for r in results] == [
        (saver.pid, "timeout"),
        (trainer.pid, "no-handler"),
    ]
    assert not saver.checkpoint.exists()


async def test_a_process_that_dies_while_saving_failed(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("die")
    await _ready(hub, trainer)
    started = time.monotonic()
    (result,) = await hub.release(reason="down", deadline=time.time() + 60)
    assert time.monotonic() - started < 30  # not the deadline: the link closed
    assert result["status"] == "failed", result
    assert result["detail"] == "the process ended before it answered"
    assert trainer.process.wait(10) == 3


class _Subscriber:
    """An SSH subscriber of the hub, as agent.server gives it one, over in-memory pipes."""

    def __init__(self, hub: ProbeHub) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.frames: list[protocol.Frame] = []
        self.inbox.put_nowait(protocol.encode(protocol.PROBE_SUBSCRIBE))
        self.task = asyncio.ensure_future(
            hub.serve(read=self._read, write=self._write, drain=self._drain)
        )

    async def _read(self, n: int) -> bytes:
        return await self.inbox.get()

    def _write(self, data: bytes) -> None:
        self.frames += [protocol.decode(line) for line in data.splitlines() if line]

    async def _drain(self) -> None:
        pass

    def ask(self, **request: Any) -> None:
        self.inbox.put_nowait(protocol.encode(protocol.PROBE_REQUEST, **request))

    def reply(self, request_id: int) -> dict[str, Any] | None:
        for frame in self.frames:
            if frame.type == protocol.PROBE_REPLY and frame.body.get("id") == request_id:
                return frame.body
        return None

    async def close(self) -> None:
        self.inbox.put_nowait(b"")
        await asyncio.wait_for(self.task, 10)


async def test_a_stuck_process_answers_with_its_stacks(hub: ProbeHub, trainers: Any) -> None:
    trainer = trainers("stuck")
    await _ready(hub, trainer)
    await _until(lambda: trainer.steps() == 3, "the stuck step")
    sub = _Subscriber(hub)
    await _until(lambda: sub.frames, "the hello")
    hello = sub.frames[0].body["processes"]
    assert sorted(p["release"] for p in hello if p["pid"] == trainer.pid) == [False, True]
    sub.ask(id=1, kind="stacks", layer="", tensor="", pid=trainer.pid)
    reply = await _until(lambda: sub.reply(1), "the stacks")
    text = reply["stacks"]
    assert reply["pid"] == trainer.pid and "error" not in reply
    assert "thread MainThread" in text and "in stuck_here" in text, text
    assert "the probe, answering this" in text  # the link thread marks itself
    await sub.close()
