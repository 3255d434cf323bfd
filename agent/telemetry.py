"""Telemetry: one sampler per box, a ring buffer of recent history, and subscribers
that each get the newest sample at their own rate.

The sampler runs in a thread of its own (NVML calls can block for seconds on a
sick GPU; the SSH server must not) at the fastest rate any subscriber asked
for, and at `base_rate` when nobody watches, so that history and the activity
signal are always there. Each sample is encoded once and the same bytes go to
every subscriber. A subscriber holds at most one pending sample: a slow reader
skips samples (the `seq` gap shows it) instead of growing a queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from agent.streams import LineReader, RequestError, fail
from devbox import protocol
from devbox.protocol import BoxProcess, GpuSample, HostSample, Sample

log = logging.getLogger("devbox.agent.telemetry")

REQUEST_TIMEOUT = 30.0
# HISTORY is sent in frames of at most this many samples, each well under MAX_FRAME_BYTES.
HISTORY_CHUNK = 120
_HISTORY_HEAD = b'{"v":%d,"type":"%s","samples":[' % (protocol.VERSION, protocol.HISTORY.encode())


class GpuSource(Protocol):
    def read(self) -> list[GpuSample]: ...


class HostSource(Protocol):
    def read(self) -> tuple[HostSample, list[BoxProcess]]: ...


class Sources(Protocol):
    """What one tick reads; opened in the sampler thread (imports and NVML init are slow)."""

    def read(self) -> tuple[list[GpuSample], HostSample, list[BoxProcess]]: ...


class Subscription:
    """One subscriber's slot: the newest sample not yet written, and when the next is due."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.pending: bytes | None = None
        self.ready = asyncio.Event()
        self._next_due = 0.0

    def offer(self, line: bytes, now: float, slack: float) -> None:
        # `slack` (half the sampler's interval) keeps a 1 Hz subscriber at 1 Hz while the
        # sampler runs at 10 Hz for someone else, instead of drifting to every 1.1 s.
        if now + slack < self._next_due:
            return
        self._next_due = max(self._next_due + 1.0 / self.rate, now)
        self.pending = line  # replaces an unsent older sample: never a backlog
        self.ready.set()

    def take(self) -> bytes | None:
        line, self.pending = self.pending, None
        self.ready.clear()
        return line


def parse_request(line: bytes) -> tuple[float, bool]:
    """(rate, history) from a SUBSCRIBE frame; RequestError says what is wrong with it."""
    try:
        frame = protocol.decode(line)
    except protocol.ProtocolError as exc:
        raise RequestError(str(exc)) from None
    if frame.type != protocol.SUBSCRIBE:
        raise RequestError(f"expected a {protocol.SUBSCRIBE!r} frame, got {frame.type!r}")
    rate = frame.body.get("rate", 1.0)
    history = frame.body.get("history", False)
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        raise RequestError("rate must be a number (samples per second)")
    if not 0 < rate <= protocol.MAX_RATE:
        raise RequestError(f"rate must be above 0 and at most {protocol.MAX_RATE:g} per second")
    if not isinstance(history, bool):
        raise RequestError("history must be true or false")
    return float(rate), history


class Telemetry:
    def __init__(
        self,
        *,
        box: str,
        open_sources: Callable[[], Sources],
        base_rate: float = 1.0,
        history_seconds: int = protocol.HISTORY_SECONDS,
        activity: Callable[[], protocol.Activity] | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        self.box = box
        self._activity = activity
        self._on_sample = on_sample  # called on the event loop, with each new sample
        self._open_sources = open_sources
        self._base_rate = base_rate
        self._subs: set[Subscription] = set()
        self._rate = base_rate  # the sampler's: the fastest any subscriber asked for
        self._poke = threading.Event()
        self._latest_line: bytes | None = None
        # Compact samples (no process tables), encoded, one per 1/base_rate seconds.
        self._history: collections.deque[bytes] = collections.deque(
            maxlen=max(1, int(history_seconds * base_rate))
        )
        self._history_t = 0.0
        self._seq = 0
        self.failure: str | None = None  # why there is no telemetry, when the sources failed

    def _rates_changed(self) -> None:
        rate = max([self._base_rate, *(s.rate for s in self._subs)])
        faster, self._rate = rate > self._rate, rate
        if faster:
            self._poke.set()  # a subscriber wants more than the sampler gives: sample now

    # --- the sampling loop ------------------------------------------------------------
    #
    # A thread of its own, not run_in_executor: each hand-off to a pool costs a second
    # thread wake-up per tick, and on a VM that was most of the agent's idle CPU.

    async def run(self, *, delay: float = 0.0) -> None:
        """Sample until cancelled. `delay`: let the first SSH connection have the CPU first."""
        await asyncio.sleep(delay)
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        ended: asyncio.Future[None] = loop.create_future()
        threading.Thread(
            target=self._sample_forever,
            args=(loop, stop, ended),
            name="devbox-telemetry",
            daemon=True,  # a call stuck in a sick GPU's driver must not hold the exit
        ).start()
        try:
            await ended  # only when the sources cannot open
        finally:
            stop.set()
            self._poke.set()

    def _sample_forever(
        self, loop: asyncio.AbstractEventLoop, stop: threading.Event, ended: asyncio.Future[None]
    ) -> None:
        try:
            sources = self._open_sources()
        except Exception as exc:  # the SSH server goes on without telemetry
            log.exception("cannot start telemetry")
            message = f"telemetry is unavailable in this box: {exc}"
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(self._fail, message, ended)
            return
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                sample, line = self._take(sources)
            except Exception:  # one bad tick must not end telemetry for good
                log.exception("sampling failed")
            else:
                try:
                    loop.call_soon_threadsafe(self._publish, sample, line)
                except RuntimeError:
                    return  # the event loop is gone: the agent is ending
            now = time.monotonic()
            next_at = max(next_at + 1.0 / self._rate, now)  # behind schedule: no burst
            if self._poke.wait(next_at - now):
                self._poke.clear()
                next_at = time.monotonic()

    def _fail(self, message: str, ended: asyncio.Future[None]) -> None:
        self.failure = message
        if not ended.done():
            ended.set_result(None)

    def _take(self, sources: Sources) -> tuple[Sample, bytes]:
        gpus, host, processes = sources.read()
        self._seq += 1
        sample: Sample = {
            "t": time.time(),
            "seq": self._seq,
            "gpus": gpus,
            "host": host,
            "processes": processes,
        }
        if self._activity is not None:
            sample["activity"] = self._activity()
        return sample, protocol.encode(protocol.SAMPLE, **sample)

    def _publish(self, sample: Sample, line: bytes) -> None:
        self._latest_line = line
        if self._on_sample is not None:
            self._on_sample(sample)
        now = time.monotonic()
        if now - self._history_t >= 0.95 / self._base_rate:
            self._history_t = now
            self._history.append(_compact(sample))
        slack = 0.5 / self._rate
        for sub in self._subs:
            sub.offer(line, now, slack)

    def history_frames(self) -> list[bytes]:
        """HISTORY frames, oldest first; built from the already-encoded compact samples."""
        items = list(self._history)
        frames = []
        for start in range(0, len(items), HISTORY_CHUNK):
            chunk = b",".join(items[start : start + HISTORY_CHUNK])
            frames.append(_HISTORY_HEAD + chunk + b"]}\n")
        return frames

    # --- one subscriber ---------------------------------------------------------------

    async def serve(
        self,
        *,
        read: Callable[[int], Awaitable[bytes]],
        write: Callable[[bytes], None],
        drain: Callable[[], Awaitable[None]],
    ) -> int:
        """Serve one subscriber over a byte stream; returns the channel's exit status."""
        lines = LineReader(read)
        try:
            rate, history = parse_request(await asyncio.wait_for(lines.next(), REQUEST_TIMEOUT))
        except TimeoutError:
            return fail(write, f"no {protocol.SUBSCRIBE} request within {REQUEST_TIMEOUT:g} s")
        except (RequestError, EOFError) as exc:
            return fail(write, str(exc) or "no request")
        if self.failure is not None:
            return fail(write, self.failure)
        sub = Subscription(rate)
        write(protocol.encode(protocol.HELLO, box=self.box, rate=rate))
        if history:
            for frame in self.history_frames():
                write(frame)
                await drain()
        self._subs.add(sub)
        self._rates_changed()
        if self._latest_line is not None:
            sub.offer(self._latest_line, time.monotonic(), 0.0)  # a snapshot needs no wait
        requests = asyncio.ensure_future(self._follow_requests(lines, sub))
        try:
            while not requests.done():
                ready = asyncio.ensure_future(sub.ready.wait())
                await asyncio.wait({ready, requests}, return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                line = sub.take()
                if line is not None:
                    write(line)
                    await drain()  # while this waits, newer samples replace `pending`
            error = requests.result()
        finally:
            self._subs.discard(sub)
            self._rates_changed()
            requests.cancel()
        return 0 if error is None else fail(write, error)

    async def _follow_requests(self, lines: LineReader, sub: Subscription) -> str | None:
        """Later SUBSCRIBE frames change the rate; EOF ends the stream (None); junk is an error."""
        while True:
            try:
                line = await lines.next()
            except EOFError:
                return None
            except RequestError as exc:
                return str(exc)
            try:
                sub.rate, _ = parse_request(line)
            except RequestError as exc:
                return str(exc)
            self._rates_changed()


def _compact(sample: Sample) -> bytes:
    """A history entry: the sample without its process tables, which are large and only
    interesting now."""
    gpus = [{**g, "processes": []} for g in sample["gpus"]]
    entry = {**sample, "gpus": gpus, "processes": []}
    return json.dumps(entry, separators=(",", ":")).encode()
