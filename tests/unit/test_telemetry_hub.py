"""The telemetry hub's policy, with plain in-memory byte streams: rates, the newest-sample
slot of a slow subscriber, history, and bad requests."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

from agent.telemetry import Subscription, Telemetry, parse_request
from devbox import protocol
from devbox.protocol import BoxProcess, GpuSample, HostSample

HOST: HostSample = {
    "cpu": [1.0, 2.0],
    "load1": 0.1,
    "mem_used": 1,
    "mem_total": 2,
    "swap_used": 0,
    "disk_read_bps": None,
    "disk_write_bps": None,
    "net_rx_bps": None,
    "net_tx_bps": None,
}
PROC: BoxProcess = {
    "pid": 1,
    "ppid": 0,
    "name": "python",
    "cmdline": "python train.py",
    "user": "me",
    "cpu": 99.0,
    "rss": 1 << 30,
    "threads": 4,
}


class CountingSources:
    """Stands in for NVML and psutil: each read is one tick, numbered."""

    def __init__(self) -> None:
        self.reads = 0
        self.brief: list[bool] = []  # per read: whether it was a quiet tick's brief one

    def read(self, *, brief: bool = False) -> tuple[list[GpuSample], HostSample, list[BoxProcess]]:
        self.reads += 1
        self.brief.append(brief)
        return [], HOST, [PROC]


class Pipe:
    """One subscriber's end: what the agent writes is collected; requests are fed in."""

    def __init__(self, *requests: bytes) -> None:
        self.incoming: asyncio.Queue[bytes] = asyncio.Queue()
        for r in requests:
            self.incoming.put_nowait(r)
        self.out: list[bytes] = []
        self.blocked = asyncio.Event()
        self.blocked.set()

    async def read(self, n: int) -> bytes:
        return await self.incoming.get()

    def write(self, data: bytes) -> None:
        self.out.append(data)

    async def drain(self) -> None:
        await self.blocked.wait()

    def frames(self) -> list[protocol.Frame]:
        return [protocol.decode(line) for chunk in self.out for line in chunk.splitlines()]


def subscribe(rate: float = 10.0, history: bool = False) -> bytes:
    return protocol.encode(protocol.SUBSCRIBE, rate=rate, history=history)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (protocol.encode("bogus"), "expected a 'subscribe' frame"),
        (protocol.encode(protocol.SUBSCRIBE, rate="fast"), "rate must be a number"),
        (protocol.encode(protocol.SUBSCRIBE, rate=0), "above 0"),
        (protocol.encode(protocol.SUBSCRIBE, rate=1000), "at most 20"),
        (protocol.encode(protocol.SUBSCRIBE, rate=True), "rate must be a number"),
        (protocol.encode(protocol.SUBSCRIBE, history="yes"), "history must be"),
    ],
)
def test_bad_requests_are_named(line: bytes, error: str) -> None:
    from agent.streams import RequestError

    with pytest.raises(RequestError, match=error):
        parse_request(line.strip())


def test_a_good_request_defaults_to_one_hertz_without_history() -> None:
    assert parse_request(protocol.encode(protocol.SUBSCRIBE).strip()) == (1.0, False)
    assert parse_request(subscribe(2.5, True).strip()) == (2.5, True)


async def _slot_keeps_newest() -> None:
    sub = Subscription(rate=100.0)
    for i in range(50):
        sub.offer(b"%d" % i, now=i * 0.01, slack=0.0)
    assert sub.take() == b"49"
    assert sub.take() is None


def test_a_slow_subscriber_holds_only_the_newest_sample() -> None:
    asyncio.run(_slot_keeps_newest())


async def _slack() -> None:
    sub = Subscription(rate=1.0)
    got = []
    # A sampler at 10 Hz for someone else, with a little jitter on each tick.
    for i in range(50):
        now = i * 0.1 + (0.003 if i % 2 else -0.003)
        before = sub.pending
        sub.offer(b"%d" % i, now=now, slack=0.05)
        if sub.pending is not before:
            got.append(sub.take())
    # 5 s of ticks: one sample per second, not one per 1.1 s.
    assert len(got) == 5


def test_a_slower_subscriber_gets_its_own_rate_while_the_sampler_runs_faster() -> None:
    asyncio.run(_slack())


async def _stream(rate: float, seconds: float) -> tuple[list[protocol.Frame], CountingSources]:
    sources = CountingSources()
    hub = Telemetry(box="b", open_sources=lambda: sources)
    runner = asyncio.create_task(hub.run())
    pipe = Pipe(subscribe(rate))
    serving = asyncio.create_task(hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain))
    await asyncio.sleep(seconds)
    pipe.incoming.put_nowait(b"")  # EOF: the subscriber leaves
    status = await serving
    runner.cancel()
    assert status == 0
    return pipe.frames(), sources


def test_the_sampler_speeds_up_for_a_subscriber_and_numbers_its_samples() -> None:
    frames, _ = asyncio.run(_stream(rate=20.0, seconds=1.0))
    assert frames[0].type == protocol.HELLO and frames[0].body["rate"] == 20.0
    samples = [f.body for f in frames if f.type == protocol.SAMPLE]
    # 20 Hz for a second, against a 1 Hz base rate: far more than 2 samples.
    assert len(samples) >= 10
    seqs = [s["seq"] for s in samples]
    assert seqs == sorted(set(seqs))
    assert samples[-1]["processes"] == [PROC] and samples[-1]["host"] == HOST


async def _slow_reader() -> tuple[list[protocol.Frame], int]:
    sources = CountingSources()
    hub = Telemetry(box="b", open_sources=lambda: sources)
    runner = asyncio.create_task(hub.run())
    pipe = Pipe(subscribe(20.0))
    pipe.blocked.clear()  # the subscriber stops reading: its writes do not drain
    serving = asyncio.create_task(hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain))
    await asyncio.sleep(1.0)
    written_while_blocked = len(pipe.out)
    pipe.blocked.set()
    await asyncio.sleep(0.3)
    pipe.incoming.put_nowait(b"")
    await serving
    runner.cancel()
    return pipe.frames(), written_while_blocked


def test_a_reader_that_stalls_skips_to_the_newest_sample() -> None:
    frames, written_while_blocked = asyncio.run(_slow_reader())
    # HELLO and one sample went out; the sender then waited on drain, writing nothing more.
    assert written_while_blocked == 2
    seqs = [f.body["seq"] for f in frames if f.type == protocol.SAMPLE]
    gaps = [b - a for a, b in itertools.pairwise(seqs)]
    assert max(gaps) >= 10  # about 20 samples were taken while it stalled; it got the last


async def _with_history() -> list[protocol.Frame]:
    sources = CountingSources()
    hub = Telemetry(box="b", open_sources=lambda: sources, base_rate=20.0, history_seconds=10)
    runner = asyncio.create_task(hub.run())
    await asyncio.sleep(0.6)
    pipe = Pipe(subscribe(1.0, history=True))
    serving = asyncio.create_task(hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain))
    await asyncio.sleep(0.1)
    pipe.incoming.put_nowait(b"")
    await serving
    runner.cancel()
    return pipe.frames()


def test_history_comes_first_oldest_first_without_process_tables() -> None:
    frames = asyncio.run(_with_history())
    assert [f.type for f in frames[:2]] == [protocol.HELLO, protocol.HISTORY]
    old = frames[1].body["samples"]
    assert len(old) >= 5
    assert [s["seq"] for s in old] == sorted(s["seq"] for s in old)
    assert all(s["processes"] == [] for s in old)
    assert frames[2].type == protocol.SAMPLE and frames[2].body["processes"] == [PROC]


async def _bad_then_good() -> tuple[list[protocol.Frame], int, list[protocol.Frame], int]:
    sources = CountingSources()
    hub = Telemetry(box="b", open_sources=lambda: sources)
    runner = asyncio.create_task(hub.run())
    good = Pipe(subscribe(10.0))
    bad = Pipe(b'{"v":1,"type":"subscribe","rate":-1}\n')
    late = Pipe(subscribe(10.0), b"garbage\n")
    serving = asyncio.create_task(hub.serve(read=good.read, write=good.write, drain=good.drain))
    bad_status = await hub.serve(read=bad.read, write=bad.write, drain=bad.drain)
    late_status = await hub.serve(read=late.read, write=late.write, drain=late.drain)
    before = len(good.frames())
    await asyncio.sleep(0.5)
    assert len(good.frames()) > before  # the good subscriber never noticed
    good.incoming.put_nowait(b"")
    await serving
    runner.cancel()
    return bad.frames(), bad_status, late.frames(), late_status


def test_a_malformed_request_closes_that_stream_only() -> None:
    bad, bad_status, late, late_status = asyncio.run(_bad_then_good())
    assert bad_status == 1 and [f.type for f in bad] == [protocol.ERROR]
    assert "above 0" in bad[0].body["message"]
    # Junk after a good subscription: an ERROR frame ends that stream too.
    assert late_status == 1 and late[-1].type == protocol.ERROR
    assert "not JSON" in late[-1].body["message"]


async def _broken_sources() -> list[protocol.Frame]:
    def fail() -> CountingSources:
        raise RuntimeError("NVML exploded")

    hub = Telemetry(box="b", open_sources=fail)
    await hub.run()  # returns: the agent goes on without telemetry
    pipe = Pipe(subscribe())
    assert await hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain) == 1
    return pipe.frames()


def test_sources_that_cannot_open_are_an_error_frame_not_a_crash() -> None:
    frames = asyncio.run(_broken_sources())
    assert frames[-1].type == protocol.ERROR
    assert "NVML exploded" in frames[-1].body["message"]


def test_history_frames_are_valid_json_in_bounded_chunks() -> None:
    hub = Telemetry(box="b", open_sources=CountingSources, history_seconds=1000)
    for i in range(300):
        hub.history.add(time.monotonic(), json.dumps({"seq": i}).encode())
    frames = [protocol.decode(f) for f in hub.history_frames()]
    assert [len(f.body["samples"]) for f in frames] == [120, 120, 60]
    assert [s["seq"] for f in frames for s in f.body["samples"]] == list(range(300))
