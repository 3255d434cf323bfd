"""The probe hub: training processes in the box connect to a Unix socket only the box's
owner can open; SSH subscribers (`devbox probe`, the TUI) get each process's newest
statistics and may send requests, which go to the process and whose replies come back to
the one who asked.

The hub tells every process whether anybody watches, so that an unwatched training loop
pays next to nothing. Each batch a process sends is activity for the autoscaler. Alerts are
kept per process (the first of each kind and layer) and written to `alerts_file` for
`devbox ls`.

Before the box goes, `release` asks every process that registered a save (its hello said
`release: true`: devbox.probe.on_release or release_requested) to save, and reports what
each saved. Such a link watches no model (its layers are []): the processes of HELLO
include it, for requests every process answers (stacks), and say so with `release`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import probesaves as saves
from agent.streams import LineReader, RequestError, fail
from agent.telemetry import REQUEST_TIMEOUT as FIRST_TIMEOUT
from devbox import private, protocol
from devbox.protocol import ProbeAlert

log = logging.getLogger("devbox.agent.probe")

REQUEST_TIMEOUT = 30.0  # a request no step answered by then: training is paused or stuck
MAX_ALERTS = 50  # per box; the first ones are kept: they say what broke first
# Replies and alert notices a subscriber has not read yet. Statistics never pile up (the
# newest replaces the unsent one), but these must each arrive, so a subscriber that falls
# this far behind is ended with an ERROR frame rather than buffered for without bound
# (a stalled one grew the agent by 1 GB in 15 s of NaN alerts).
MAX_BACKLOG_BYTES = 4 << 20
MAX_BACKLOG_FRAMES = 1000
MAX_WAITING = 64  # requests of one subscriber not answered yet
_ids = itertools.count(1)


@dataclass(eq=False)
class ProcessLink:
    key: int  # the hub's own number for this connection (one process may watch two models)
    pid: int
    cmd: str
    layers: list[str]
    every: int
    writer: asyncio.StreamWriter
    latest: bytes | None = None  # the newest PROBE_STATS line with layer statistics
    release: bool = False  # the process saves before a release (probe.on_release)
    framework: str = ""  # what its probe hooks: "torch", "keras/jax", "jax" (hello)

    def info(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "cmd": self.cmd,
            "layers": self.layers,
            "every": self.every,
            "release": self.release,
            "framework": self.framework,
        }


@dataclass(eq=False)
class Subscriber:
    # Newest line per process not yet written, plus replies and notices in order.
    pending: dict[int, bytes] = field(default_factory=dict)
    notices: list[bytes] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    backlog: int = 0  # bytes in `notices`
    # Set when `notices` would pass the bound: the subscriber is ended, nothing more kept.
    overflow: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0  # its requests forwarded and not answered yet

    def offer(self, key: int, line: bytes) -> None:
        if self.overflow.is_set():
            return
        self.pending[key] = line  # replaces an unsent older batch: never a backlog
        self.ready.set()

    def notify(self, line: bytes) -> None:
        if self.overflow.is_set():
            return
        if self.backlog + len(line) > MAX_BACKLOG_BYTES or len(self.notices) >= MAX_BACKLOG_FRAMES:
            self.notices, self.pending, self.backlog = [], {}, 0
            self.overflow.set()
        else:
            self.notices.append(line)
            self.backlog += len(line)
        self.ready.set()

    def take(self) -> list[bytes]:
        lines = self.notices + list(self.pending.values())
        self.notices, self.pending, self.backlog = [], {}, 0
        self.ready.clear()
        return lines


class ProbeHub:
    def __init__(
        self,
        *,
        box: str,
        path: Path,
        on_batch: Callable[[], None],
        alerts_file: Path | None = None,
    ) -> None:
        self.box = box
        self.path = path
        self._on_batch = on_batch
        self._alerts_file = alerts_file
        self.processes: dict[int, ProcessLink] = {}
        self._subs: set[Subscriber] = set()
        self.alerts: list[ProbeAlert] = []
        # Per alert, the key of the connection that raised it: alerts belong to a process,
        # and a finished one's give way once a process after it reports healthy.
        self._alert_links: list[int] = []
        self._alert_keys: set[tuple[int, str, str]] = set()
        # hub request id -> (subscriber, the subscriber's own id)
        self._waiting: dict[int, tuple[Subscriber, int]] = {}
        # release id -> (the link asked, its answer: None when the process ended first)
        self._saving: dict[int, tuple[ProcessLink, saves.Answer]] = {}
        self._server: asyncio.AbstractServer | None = None
        # Told of every change of `alerts`; in a pod, agent.incluster annotates the pod.
        self.on_alerts: Callable[[list[ProbeAlert]], None] | None = None

    # --- the socket training processes use --------------------------------------------

    async def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a previous agent's
        self._server = await asyncio.start_unix_server(
            self._serve_process, path=str(self.path), limit=protocol.MAX_FRAME_BYTES
        )
        os.chmod(self.path, 0o600)
        self._write_alerts()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.processes.values()):
            link.writer.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            if self.path.parent.name.startswith(protocol.PROBE_FOLDER_PREFIX):  # its own mkdtemp
                self.path.parent.rmdir()

    async def _serve_process(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        link: ProcessLink | None = None
        try:
            hello = protocol.decode(await asyncio.wait_for(reader.readline(), 30))
            if hello.type != protocol.PROBE_HELLO:
                raise protocol.ProtocolError(f"expected {protocol.PROBE_HELLO}, got {hello.type}")
            body = hello.body
            link = ProcessLink(
                key=next(_ids),
                pid=int(body.get("pid", 0)),
                cmd=str(body.get("cmd", ""))[:200],
                layers=[str(n) for n in body.get("layers", [])][:10000],
                every=int(body.get("every", 1)),
                writer=writer,
                release=body.get("release") is True,
                framework=str(body.get("framework", ""))[:40],
            )
            self.processes[link.key] = link
            if link.layers:  # the subscribers learn of it as of those in their HELLO
                joined = protocol.encode(protocol.PROBE_HELLO, **link.info())
                for sub in self._subs:
                    sub.notify(joined)
            writer.write(protocol.encode(protocol.PROBE_CONTROL, watching=bool(self._subs)))
            while line := await reader.readline():
                if not line.endswith(b"\n"):
                    break
                self._from_process(link, protocol.decode(line), line)
        except (protocol.ProtocolError, ValueError, TypeError, TimeoutError) as exc:
            log.warning("dropped a probe connection: %s", exc)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            if link is not None:
                del self.processes[link.key]
                for asked, answer in self._saving.values():
                    if asked is link and not answer.done():
                        answer.set_result(None)
                gone = protocol.encode(protocol.PROBE_GONE, pid=link.pid)
                for sub in self._subs:
                    sub.pending.pop(link.key, None)
                    sub.notify(gone)
            writer.close()

    def _from_process(self, link: ProcessLink, frame: protocol.Frame, line: bytes) -> None:
        if frame.type == protocol.PROBE_STATS:
            self._on_batch()
            raised = frame.body.get("alerts") or []
            if isinstance(raised, list) and raised:
                self._add_alerts(link, raised)
            else:
                self._drop_finished_alerts()
            if frame.body.get("watched"):
                # Kept for a subscriber who joins while others watch. Not while nobody
                # does: a report sent as the last one left would be served, later, as now.
                if self._subs:
                    link.latest = line
                for sub in self._subs:
                    sub.offer(link.key, line)
            elif raised:
                for sub in self._subs:
                    sub.notify(line)
        elif frame.type == protocol.PROBE_SAVED:
            self._saved(link, frame)
        elif frame.type == protocol.PROBE_REPLY:
            hub_id = frame.body.get("id")
            waiting = self._waiting.pop(hub_id, None) if isinstance(hub_id, int) else None
            if waiting is not None:
                sub, their_id = waiting
                sub.waiting -= 1
                sub.notify(protocol.encode(protocol.PROBE_REPLY, **{**frame.body, "id": their_id}))

    def _saved(self, link: ProcessLink, frame: protocol.Frame) -> None:
        hub_id = frame.body.get("id")
        waiting = self._saving.get(hub_id) if isinstance(hub_id, int) else None
        if waiting is None or waiting[0] is not link or waiting[1].done():
            return  # late (the release is over), or not this process's to answer
        try:
            answer = protocol.probe_saved(frame)
        except protocol.ProtocolError as exc:
            answer = {"id": 0, "pid": link.pid, "saved": [], "error": exc.message}
        waiting[1].set_result(answer)

    # --- the release handshake --------------------------------------------------------

    async def release(self, *, reason: str, deadline: float) -> list[protocol.SaveResult]:
        """Ask every process that can save to save, and wait for their answers until
        `deadline` (unix time). One result per such process, plus a "no-handler" one per
        probed process that registered no save. Never raises."""
        asked = [link for link in self.processes.values() if link.release]
        savers = {link.pid for link in asked}
        others: dict[int, ProcessLink] = {}
        for link in self.processes.values():
            if link.pid not in savers:
                others.setdefault(link.pid, link)
        limit = deadline - time.time()
        if limit > 0 and asked:
            answers = self._ask_to_save(asked, reason=reason, deadline=deadline)
            try:
                await asyncio.wait([a for _, a in answers.values()], timeout=limit)
            finally:
                for hub_id in answers:
                    self._saving.pop(hub_id, None)
            results = [
                saves.result(link.pid, link.cmd, answer, limit=limit)
                for link, answer in answers.values()
            ]
        else:
            results = [saves.result(link.pid, link.cmd, None, limit=limit) for link in asked]
        return results + [saves.no_handler(link.pid, link.cmd) for link in others.values()]

    def _ask_to_save(
        self, links: list[ProcessLink], *, reason: str, deadline: float
    ) -> dict[int, tuple[ProcessLink, saves.Answer]]:
        loop = asyncio.get_running_loop()
        answers = {}
        for link in links:
            hub_id = next(_ids)
            answers[hub_id] = (link, loop.create_future())
            self._saving[hub_id] = answers[hub_id]
            frame = protocol.encode(
                protocol.PROBE_RELEASE, id=hub_id, reason=reason, deadline=deadline
            )
            try:
                link.writer.write(frame)
            except (OSError, RuntimeError):
                answers[hub_id][1].set_result(None)  # closing: it cannot answer
        return answers

    def _add_alerts(self, link: ProcessLink, raised: list[Any]) -> None:
        changed = False
        for alert in raised:
            if not isinstance(alert, dict):
                continue
            key = (link.key, str(alert.get("kind", "")), str(alert.get("layer", "")))
            if key in self._alert_keys or len(self.alerts) >= MAX_ALERTS:
                continue
            self._alert_keys.add(key)
            self._alert_links.append(link.key)
            self.alerts.append(
                {
                    "kind": key[1],
                    "layer": key[2],
                    "step": int(alert.get("step", 0)),
                    "message": str(alert.get("message", ""))[:300],
                    "pid": link.pid,
                    "t": time.time(),
                }
            )
            changed = True
        if changed:
            self._alerts_changed()

    def _drop_finished_alerts(self) -> None:
        """A healthy report: the alerts of processes that have ended are history now, not
        the state of the box (`devbox ls` showed a NaN of the last run next to this one)."""
        if all(key in self.processes for key in self._alert_links):
            return
        kept = [(k, a) for k, a in zip(self._alert_links, self.alerts, strict=True)
                if k in self.processes]  # fmt: skip
        self._alert_links, self.alerts = [k for k, _ in kept], [a for _, a in kept]
        self._alert_keys = {k for k in self._alert_keys if k[0] in self.processes}
        self._alerts_changed()

    def _alerts_changed(self) -> None:
        self._write_alerts()
        if self.on_alerts is not None:
            self.on_alerts(list(self.alerts))

    def _write_alerts(self) -> None:
        if self._alerts_file is None:
            return
        try:
            private.write_text(self._alerts_file, json.dumps({"alerts": self.alerts}))
        except OSError as exc:
            log.warning("cannot write %s: %s", self._alerts_file, exc)

    def _watching_changed(self) -> None:
        line = protocol.encode(protocol.PROBE_CONTROL, watching=bool(self._subs))
        for link in self.processes.values():
            if not self._subs:
                link.latest = None  # stale from now on: the process sends no statistics
            with contextlib.suppress(OSError, RuntimeError):
                link.writer.write(line)

    # --- one SSH subscriber -----------------------------------------------------------

    async def serve(
        self,
        *,
        read: Callable[[int], Awaitable[bytes]],
        write: Callable[[bytes], None],
        drain: Callable[[], Awaitable[None]],
    ) -> int:
        lines = LineReader(read)
        try:
            first = protocol.decode(await asyncio.wait_for(lines.next(), FIRST_TIMEOUT))
        except TimeoutError:
            return fail(write, f"no {protocol.PROBE_SUBSCRIBE} request in {FIRST_TIMEOUT:g} s")
        except (RequestError, EOFError, protocol.ProtocolError) as exc:
            return fail(write, str(exc) or "no request")
        if first.type != protocol.PROBE_SUBSCRIBE:
            return fail(write, f"expected a {protocol.PROBE_SUBSCRIBE!r} frame, got {first.type!r}")
        sub = Subscriber()
        write(
            protocol.encode(
                protocol.HELLO,
                box=self.box,
                processes=[p.info() for p in self.processes.values()],
                alerts=self.alerts,
            )
        )
        self._subs.add(sub)
        if len(self._subs) == 1:
            self._watching_changed()
        for link in self.processes.values():
            if link.latest is not None:
                sub.offer(link.key, link.latest)
        requests = asyncio.ensure_future(self._follow_requests(lines, sub))
        overflow = asyncio.ensure_future(sub.overflow.wait())
        try:
            while not (requests.done() or overflow.done()):
                ready = asyncio.ensure_future(sub.ready.wait())
                await asyncio.wait({ready, requests}, return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                for line in sub.take():
                    write(line)
                # A subscriber that stopped reading blocks here; its overflow ends the wait.
                drained = asyncio.ensure_future(drain())
                await asyncio.wait({drained, overflow}, return_when=asyncio.FIRST_COMPLETED)
                if drained.done():
                    drained.result()  # raises as drain did: the subscriber went away
                else:
                    drained.cancel()
            if overflow.done():
                error: str | None = (
                    f"this subscriber fell more than {MAX_BACKLOG_FRAMES} frames or "
                    f"{MAX_BACKLOG_BYTES >> 20} MiB behind and was disconnected"
                )
            else:
                error = requests.result()
        finally:
            overflow.cancel()
            self._subs.discard(sub)
            if not self._subs:
                self._watching_changed()
            for hub_id in [k for k, (s, _) in self._waiting.items() if s is sub]:
                del self._waiting[hub_id]
            requests.cancel()
        return 0 if error is None else fail(write, error)

    async def _follow_requests(self, lines: LineReader, sub: Subscriber) -> str | None:
        while True:
            try:
                line = await lines.next()
                frame = protocol.decode(line)
            except EOFError:
                return None
            except (RequestError, protocol.ProtocolError) as exc:
                return str(exc)
            if frame.type == protocol.PROBE_REQUEST:
                self._forward(sub, frame.body)

    def _forward(self, sub: Subscriber, body: dict[str, Any]) -> None:
        their_id = body.get("id")
        if isinstance(their_id, bool) or not isinstance(their_id, int):
            sub.notify(_reply_error(0, 0, "a request needs an integer id"))
            return
        link = self._choose(body.get("pid"), body.get("kind"))
        if link is None:
            pid = body.get("pid")
            why = f"no probed process {pid}" if pid is not None else "no probed process"
            sub.notify(_reply_error(their_id, 0, f"{why} in box {self.box}"))
            return
        if sub.waiting >= MAX_WAITING:
            sub.notify(_reply_error(their_id, link.pid, f"{MAX_WAITING} requests wait already"))
            return
        hub_id = next(_ids)
        sub.waiting += 1
        self._waiting[hub_id] = (sub, their_id)
        link.writer.write(protocol.encode(protocol.PROBE_REQUEST, **{**body, "id": hub_id}))
        asyncio.get_running_loop().call_later(REQUEST_TIMEOUT, self._expire, hub_id, link.pid)

    def _choose(self, pid: object, kind: object = None) -> ProcessLink | None:
        links = list(self.processes.values())
        if kind != "stacks":  # the others ask about a model: a release link has none
            links = [link for link in links if link.layers] or links
        if pid is None:
            return links[-1] if links else None  # the newest
        return next((p for p in reversed(links) if p.pid == pid), None)

    def _expire(self, hub_id: int, pid: int) -> None:
        waiting = self._waiting.pop(hub_id, None)
        if waiting is not None:
            sub, their_id = waiting
            sub.waiting -= 1
            message = f"process {pid} did not answer in {REQUEST_TIMEOUT:g} s (training paused?)"
            sub.notify(_reply_error(their_id, pid, message))


def _reply_error(request_id: int, pid: int, message: str) -> bytes:
    return protocol.encode(protocol.PROBE_REPLY, id=request_id, pid=pid, step=0, error=message)
