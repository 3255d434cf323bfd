"""Telemetry: one sampler per box, a ring buffer of recent history, and subscribers
that each get the newest sample at their own rate.

The sampler runs in a thread of its own (NVML calls can block for seconds on a
sick GPU; the SSH server must not) at the fastest rate any subscriber asked
for, and at `base_rate` when nobody watches, so that history and the activity
signal are always there. Each sample is encoded once and the same bytes go to
every subscriber. A subscriber holds at most one pending sample: a slow reader
skips samples (the `seq` gap shows it) instead of growing a queue.

An idle box costs nothing it need not: while nobody watches and the box is quiet
(`quiet()`, the activity record's verdict: no use, no run, no load for a while) the
sampler ticks once every `quiet_interval` seconds instead of `base_rate` times a
second. That still judges the hang rule (quiet GPUs are not busy, so not stalled;
GPUs turning busy end the quiet at the next tick), keeps the activity record fresh
enough to be the local box's heartbeat, and records history at that interval; use,
a subscriber or load brings the full rate back at once (`hurry`, or the next tick).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from agent.history import History
from agent.streams import LineReader, RequestError, fail
from devbox import protocol
from devbox.protocol import BoxProcess, GpuSample, HostSample, Sample

log = logging.getLogger("devbox.agent.telemetry")

REQUEST_TIMEOUT = 30.0
# HISTORY is sent in frames of at most this many samples, each well under MAX_FRAME_BYTES.
HISTORY_CHUNK = 120
_HISTORY_HEAD = b'{"v":%d,"type":"%s","samples":[' % (protocol.VERSION, protocol.HISTORY.encode())
# Seconds between ticks while the box is quiet and unwatched: well inside the autoscaler's
# unhealthy_after (2 minutes by default; 20 s in the tests that shorten it), since each
# tick rewrites the activity file whose age is the local box's heartbeat, and as often as
# a pod's Lease is renewed.
QUIET_INTERVAL = 10.0


class GpuSource(Protocol):
    def read(self) -> list[GpuSample]: ...


class HostSource(Protocol):
    def read(self) -> tuple[HostSample, list[BoxProcess]]: ...


class Sources(Protocol):
    """What one tick reads; opened in the sampler thread (imports and NVML init are slow).
    brief: a quiet tick nobody watches, which may leave out what only a watcher reads."""

    def read(
        self, *, brief: bool = False
    ) -> tuple[list[GpuSample], HostSample, list[BoxProcess]]: ...


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
        quiet: Callable[[], bool] | None = None,
        quiet_interval: float = QUIET_INTERVAL,
    ) -> None:
        self.box = box
        self._activity = activity
        self._on_sample = on_sample  # called on the event loop, with each new sample
        self._open_sources = open_sources
        self._base_rate = base_rate
        self._subs: set[Subscription] = set()
        self._rate = base_rate  # the sampler's: the fastest any subscriber asked for
        # Wakes the sampler thread: to sample at once (`_now`), or to plan its next tick
        # again because the rate changed (a quiet box's slow ticks began or ended).
        self._poke = threading.Event()
        self._now = False
        self._last_tick = 0.0  # monotonic: when the sampler's newest tick was due
        self._latest_line: bytes | None = None
        self._latest_at = 0.0  # monotonic: when the newest sample was published
        # Whether the box may be sampled slowly (None: never); asked on the event loop
        # after each sample. `slow` is the answer, read by the sampler thread.
        self._quiet = quiet
        self._quiet_interval = quiet_interval
        self.slow = False
        # Compact samples (no process tables), encoded, one per 1/base_rate seconds.
        self.history = History(history_seconds)
        self._history_t = 0.0
        self._seq = 0
        self.failure: str | None = None  # why there is no telemetry, when the sources failed

    def _rates_changed(self) -> None:
        rate = max([self._base_rate, *(s.rate for s in self._subs)])
        faster, self._rate = rate > self._rate, rate
        if faster or (self.slow and self._subs):
            # A subscriber wants more than the sampler gives: sample now.
            self.slow = False
            self._sample_now()

    def hurry(self) -> None:
        """Back to the full rate now (someone uses the box); on the event loop."""
        if self.slow:
            self.slow = False
            self._sample_now()

    def _sample_now(self) -> None:
        self._now = True
        self._poke.set()

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
            wait = next_at - time.monotonic()
            if wait > 0 and self._poke.wait(wait):
                self._poke.clear()
                if not self._now:  # only the rate changed: wait for the tick it puts next
                    next_at = self._last_tick + self._interval()
                    continue
            self._now = False
            self._last_tick = next_at = min(next_at, time.monotonic())
            try:
                sample, line = self._take(sources)
            except Exception:  # one bad tick must not end telemetry for good
                log.exception("sampling failed")
            else:
                try:
                    loop.call_soon_threadsafe(self._publish, sample, line)
                except RuntimeError:
                    return  # the event loop is gone: the agent is ending
            next_at = max(next_at + self._interval(), time.monotonic())  # late: no burst

    def _interval(self) -> float:
        return self._quiet_interval if self.slow else 1.0 / self._rate

    def _fail(self, message: str, ended: asyncio.Future[None]) -> None:
        self.failure = message
        if not ended.done():
            ended.set_result(None)

    def _take(self, sources: Sources) -> tuple[Sample, bytes]:
        unwatched = self.slow and not self._subs
        gpus, host, processes = sources.read(brief=unwatched)
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
        if unwatched:
            # Nobody to send it to, and a later subscriber gets a fresh one, not this.
            return sample, b""
        return sample, protocol.encode(protocol.SAMPLE, **sample)

    def _publish(self, sample: Sample, line: bytes) -> None:
        now = time.monotonic()
        if self._on_sample is not None:
            self._on_sample(sample)
        if now - self._history_t >= 0.95 / self._base_rate:
            self._history_t = now
            self.history.add(now, _compact(sample))
        if line:  # not a quiet tick nobody watched (a subscriber since: a fresh one comes)
            self._latest_line, self._latest_at = line, now
            slack = 0.5 / self._rate
            for sub in self._subs:
                sub.offer(line, now, slack)
        slow = not self._subs and self._quiet is not None and self._quiet()
        if slow != self.slow:
            self.slow = slow
            self._poke.set()  # the sampler may be waiting for a tick this changes

    def history_frames(self) -> list[bytes]:
        """HISTORY frames, oldest first; built from the already-encoded compact samples."""
        items = self.history.entries(time.monotonic())
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
        now = time.monotonic()
        # A snapshot needs no wait; one from a quiet tick seconds ago is stale, and the
        # poke above brings a fresh one at once.
        if self._latest_line is not None and now - self._latest_at <= 1.5 / self._base_rate:
            sub.offer(self._latest_line, now, 0.0)
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
