"""The client end of a box's probe stream (see devbox.protocol): one SSH subsystem channel
on the box's own authenticated connection; requests go up the same channel. `stacks` asks
every probed process for its threads' stacks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from devbox import protocol
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.protocol import ProbeRequest
from devbox.ssh import frames as frames_mod
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.client import session

WINDOW = 256 * 1024  # as telemetry: a slow reader is felt at once and skips to the newest
_KINDS = (
    protocol.HELLO,
    protocol.PROBE_HELLO,
    protocol.PROBE_STATS,
    protocol.PROBE_REPLY,
    protocol.PROBE_GONE,
)


async def frames(
    conn: asyncssh.SSHClientConnection,
    box: str,
    *,
    requests: Sequence[ProbeRequest] = (),
    outbox: asyncio.Queue[ProbeRequest] | None = None,
) -> AsyncGenerator[protocol.Frame, None]:
    """HELLO, then PROBE_HELLO / PROBE_STATS / PROBE_REPLY / PROBE_GONE frames until the
    agent ends the stream; an ERROR frame raises. `requests` go up at once, `outbox` ones
    as they come. A lost connection raises a DevboxError (callers need not know asyncssh)."""
    with frames_mod.lost_as_error(box, what="probe"):
        process = await conn.create_process(
            subsystem=protocol.PROBE_SUBSYSTEM, encoding=None, window=WINDOW
        )
        pump: asyncio.Task[None] | None = None
        try:
            process.stdin.write(protocol.encode(protocol.PROBE_SUBSCRIBE))
            for request in requests:
                process.stdin.write(protocol.encode(protocol.PROBE_REQUEST, **request))
            if outbox is not None:
                pump = asyncio.ensure_future(_pump(outbox, process.stdin.write))
            async for frame in frames_mod.read(process, box=box, what="probe", kinds=_KINDS):
                yield frame
        finally:
            if pump is not None:
                pump.cancel()
            process.close()


async def _pump(outbox: asyncio.Queue[ProbeRequest], write: Callable[[bytes], None]) -> None:
    while True:
        write(protocol.encode(protocol.PROBE_REQUEST, **(await outbox.get())))


def stream(
    box: Box,
    sock: socket.socket,
    *,
    requests: Sequence[ProbeRequest] = (),
    on_frame: Callable[[protocol.Frame], bool],
    timeout: float | None = None,
    waiting_for: str = "an answer",
) -> None:
    """Connect and feed frames to `on_frame` until it returns False; `timeout` bounds the
    whole exchange (None: until ctrl-c)."""

    async def follow() -> None:
        async with session(box, sock) as conn:
            async for frame in frames(conn, box.name, requests=requests):
                if not on_frame(frame):
                    return

    async def main() -> None:
        try:
            await asyncio.wait_for(follow(), timeout)
        except TimeoutError:
            raise DevboxError(f"box {box.name}: no {waiting_for} within {timeout:g} s") from None

    asyncio.run(main())


STACKS_WAIT = 5.0  # the probe's own thread answers at once; longer is a frozen process


@dataclass(frozen=True)
class Stacks:
    """One process's answer to a stacks request: its threads' stacks, or why none came."""

    pid: int
    cmd: str
    text: str | None
    error: str = ""


def stacks(
    box: Box, sock: socket.socket, *, pid: int | None, timeout: float, wait: float = STACKS_WAIT
) -> list[Stacks]:
    """Every thread's stack of each probed process in the box (of `pid` only, if given),
    watchers and release-only links alike; [] when no process uses devbox.probe. `timeout`
    bounds the connection, `wait` the answers once asked."""

    async def follow() -> list[Stacks]:
        outbox: asyncio.Queue[ProbeRequest] = asyncio.Queue()
        async with session(box, sock) as conn:
            stream = frames(conn, box.name, outbox=outbox)
            try:
                hello = await anext(stream)
                processes: dict[int, str] = {}
                for p in hello.body.get("processes") or []:
                    if isinstance(p, dict) and isinstance(p.get("pid"), int):
                        processes.setdefault(p["pid"], str(p.get("cmd", "")))
                if pid is not None:
                    processes = {k: v for k, v in processes.items() if k == pid}
                asked = dict(enumerate(processes, 1))
                for request_id, one in asked.items():
                    request: ProbeRequest = {
                        "id": request_id, "kind": "stacks", "layer": "", "tensor": "", "pid": one
                    }  # fmt: skip
                    outbox.put_nowait(request)
                answers = await _answers(stream, set(asked), wait) if asked else {}
            finally:
                await stream.aclose()
        return [_stacks(one, processes[one], answers.get(i), wait) for i, one in asked.items()]

    async def main() -> list[Stacks]:
        try:
            return await asyncio.wait_for(follow(), timeout + wait)
        except TimeoutError:
            raise DevboxError(f"box {box.name}: no probe stream within {timeout:g} s") from None

    return asyncio.run(main())


async def _answers(
    stream: AsyncIterator[protocol.Frame], ids: set[int], wait: float
) -> dict[int, dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait):
            async for frame in stream:
                request_id = frame.body.get("id")
                if frame.type == protocol.PROBE_REPLY and request_id in ids:
                    got[request_id] = frame.body
                    if len(got) == len(ids):
                        break
    return got


def _stacks(pid: int, cmd: str, reply: dict[str, Any] | None, wait: float) -> Stacks:
    if reply is None:
        why = f"no answer within {wait:g} s (stopped, or blocked in C code that holds the GIL?)"
        return Stacks(pid, cmd, None, why)
    if "error" in reply or not isinstance(reply.get("stacks"), str):
        return Stacks(pid, cmd, None, str(reply.get("error", "no stacks in its answer")))
    return Stacks(pid, cmd, str(reply["stacks"]))
