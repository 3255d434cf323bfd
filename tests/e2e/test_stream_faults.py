"""One broken stream never disturbs another: a malformed (too deeply nested) frame ends
its own channel only, a subscriber that stops reading cannot make the agent grow without
bound, and a reader that closes `devbox`'s stdout early ends it quietly. Real agents, real
SSH connections (devbox's own asyncssh client), a real pipe."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest

from devbox import protocol
from devbox.backends.local import LocalBackend
from devbox.config import Config
from devbox.ssh import client
from devbox.ssh._asyncssh import asyncssh
from tests.conftest import User
from tests.e2e.helpers import start_devbox
from tests.waiting import wait_until

MIB = 1 << 20
# Far under every size limit (64 KiB per request), far over any recursion limit.
DEEP = b'{"v":1,"type":"subscribe","rate":' + b"[" * 30000 + b"]" * 30000 + b"}\n"


@pytest.fixture
def as_user(user: User, monkeypatch: pytest.MonkeyPatch) -> User:
    """This process connects as `user` (HOME, state, keys)."""
    for key, value in user.env.items():
        monkeypatch.setenv(key, value)
    return user


async def _connect(name: str) -> asyncssh.SSHClientConnection:
    backend = LocalBackend(config=Config())
    box = backend.get(name)
    sock = backend.open_socket(box)
    sock.settimeout(None)
    return await client.connect(box, sock)


async def _frames(process: Any) -> AsyncIterator[protocol.Frame]:
    while line := await process.stdout.readline():
        yield protocol.decode(line)


async def _next(frames: AsyncIterator[protocol.Frame], kind: str) -> protocol.Frame:
    async def find() -> protocol.Frame:
        async for frame in frames:
            if frame.type == kind:
                return frame
        raise AssertionError(f"the stream ended before a {kind} frame")

    return await asyncio.wait_for(find(), 30)


async def _telemetry(conn: asyncssh.SSHClientConnection) -> Any:
    process = await conn.create_process(subsystem=protocol.TELEMETRY_SUBSYSTEM, encoding=None)
    process.stdin.write(protocol.encode(protocol.SUBSCRIBE, rate=10.0, history=False))
    return process


async def test_a_too_deep_frame_ends_its_own_stream_only(as_user: User) -> None:
    as_user.up("deep")
    conn = await _connect("deep")
    try:
        healthy = await _telemetry(conn)
        samples = _frames(healthy)
        await _next(samples, protocol.SAMPLE)
        # On a telemetry channel, as its first request.
        bad = await conn.create_process(subsystem=protocol.TELEMETRY_SUBSYSTEM, encoding=None)
        bad.stdin.write(DEEP)
        error = await _next(_frames(bad), protocol.ERROR)
        assert "nested too deeply" in error.body["message"], error
        await asyncio.wait_for(bad.wait_closed(), 30)
        assert bad.exit_status == 1
        # On a probe channel, as a request after a good subscribe.
        probe = await conn.create_process(subsystem=protocol.PROBE_SUBSYSTEM, encoding=None)
        probe.stdin.write(protocol.encode(protocol.PROBE_SUBSCRIBE))
        probe_frames = _frames(probe)
        await _next(probe_frames, protocol.HELLO)
        probe.stdin.write(b'{"v":1,"type":"probe-request","id":' + DEEP[34:])
        error = await _next(probe_frames, protocol.ERROR)
        assert "nested too deeply" in error.body["message"], error
        await asyncio.wait_for(probe.wait_closed(), 30)
        # The connection and its other channel never noticed.
        first = (await _next(samples, protocol.SAMPLE)).body["seq"]
        later = await _next(samples, protocol.SAMPLE)
        assert later.body["seq"] > first
        again = await _telemetry(conn)
        await _next(_frames(again), protocol.SAMPLE)
    finally:
        conn.close()


def _stats(step: int, *, watched: bool, pad: int) -> bytes:
    # An unwatched report with an alert (as devbox.probe sends a NaN check's) must reach
    # every subscriber: the hub queues it, where a watched report only replaces the last.
    alert = {"kind": "nan", "layer": "fc", "step": step, "message": "x" * pad}
    return protocol.encode(
        protocol.PROBE_STATS, pid=4242, step=step, t=time.time(), watched=watched,
        layers=[], alerts=[] if watched else [alert],
    )  # fmt: skip


async def test_a_stalled_probe_subscriber_leaves_the_agent_bounded(as_user: User) -> None:
    info = as_user.up("stall")
    agent = psutil.Process(int(info["extra"]["pid"]))
    pointer = as_user.box_dir("stall") / "home" / protocol.PROBE_POINTER_FILE
    wait_until(pointer.exists, what="the probe socket's pointer")
    _, writer = await asyncio.open_unix_connection(pointer.read_text().strip())
    hello = dict(pid=4242, cmd="flood", layers=["fc"], every=1)
    writer.write(protocol.encode(protocol.PROBE_HELLO, **hello))

    stalled_conn, reading_conn = await _connect("stall"), await _connect("stall")
    try:
        # Subscribes, then never reads: its small window fills and the agent's writes wait.
        stalled = await stalled_conn.create_process(
            subsystem=protocol.PROBE_SUBSYSTEM, encoding=None, window=64 * 1024
        )
        stalled.stdin.write(protocol.encode(protocol.PROBE_SUBSCRIBE))
        reading = await reading_conn.create_process(
            subsystem=protocol.PROBE_SUBSYSTEM, encoding=None
        )
        reading.stdin.write(protocol.encode(protocol.PROBE_SUBSCRIBE))
        frames = _frames(reading)
        await _next(frames, protocol.HELLO)
        before = agent.memory_info().rss
        # 120 MiB of alert frames, in bursts the reading subscriber reads to the end of.
        step, burst, pad, watched_seen = 0, 200, 5000, 0
        for _ in range(120 * MIB // (burst * pad)):
            for _ in range(burst):
                step += 1
                writer.write(_stats(step, watched=False, pad=pad))
            step += 1
            writer.write(_stats(step, watched=True, pad=0))
            await writer.drain()
            while True:
                frame = await _next(frames, protocol.PROBE_STATS)
                watched_seen += frame.body["watched"]
                if frame.body["step"] == step:
                    break
        grown = (agent.memory_info().rss - before) / MIB
        print(f"agent RSS grew by {grown:.1f} MiB over {step} frames")
        assert grown < 30, f"the agent grew by {grown:.0f} MiB"
        assert watched_seen > 100  # the reading subscriber got every burst's report
        # The stalled one was told why it was dropped, once it reads again.
        async for frame in _frames(stalled):
            if frame.type == protocol.ERROR:
                assert "behind" in frame.body["message"], frame
                break
        else:
            raise AssertionError("the stalled subscriber's stream ended without an error")
    finally:
        writer.close()
        stalled_conn.close()
        reading_conn.close()


def test_a_reader_that_closes_the_pipe_ends_devbox_quietly(user: User) -> None:
    for name in ("pipe-a", "pipe-b"):
        user.up(name)
    for args in (("ls", "--json"), ("ls",), ("--help",), ("ssh-config",)):
        # The reader is gone before devbox writes a byte: its write meets EPIPE for sure.
        proc = start_devbox(user, *args)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        status = proc.wait(timeout=60)
        assert err == b"", (args, err.decode())
        assert status in (0, 141), (args, status)
    # As a user meets it: `head` leaves after its 10 bytes.
    pipeline = subprocess.run(
        f"{sys.executable} -m devbox ls --json | head -c 10 >/dev/null; "
        'echo "status=${PIPESTATUS[0]}"',
        shell=True,
        executable="/bin/bash",
        env=user.env,
        capture_output=True,
        cwd=user.home,
        timeout=60,
    )
    assert pipeline.stderr == b"", pipeline.stderr.decode()
    assert pipeline.stdout.strip() in (b"status=0", b"status=141"), pipeline.stdout


def test_an_os_error_names_what_failed_in_one_line(user: User) -> None:
    (user.home / ".ssh").write_text("a file where a folder should be\n")
    result = user.devbox("ssh-config", "--write")
    assert result.returncode == 1, result
    line = result.stderr.decode()
    assert line.count("\n") == 1 and "unexpected" not in line, line
    assert line.startswith("devbox: error: Not a directory: ") and str(user.home / ".ssh") in line
