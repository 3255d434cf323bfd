"""An idle, unwatched box samples slowly (agent.telemetry's quiet ticks), and comes back to its
full rate for a subscriber or for use; the activity record decides when the box is quiet."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agent.activity import QUIET_AFTER, Activity
from agent.telemetry import Telemetry
from devbox import hang, protocol
from devbox.protocol import GpuSample
from tests.unit.test_telemetry_hub import HOST, CountingSources, Pipe, subscribe


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _quiet_hub(sources: CountingSources, *, quiet_interval: float) -> Telemetry:
    """A hub at 20 Hz whose box is always quiet: its ticks come every `quiet_interval`."""
    return Telemetry(
        box="b",
        open_sources=lambda: sources,
        base_rate=20.0,
        quiet=lambda: True,
        quiet_interval=quiet_interval,
    )


async def _quiet_then_watched() -> tuple[int, int, list[protocol.Frame], float, list[bool]]:
    sources = CountingSources()
    # 20 Hz when not quiet; quiet ticks an hour apart: once slow, no tick comes by itself.
    hub = _quiet_hub(sources, quiet_interval=3600.0)
    runner = asyncio.create_task(hub.run())
    await _until(lambda: hub.slow and sources.reads >= 1, "the sampler to slow down")
    slowed = sources.reads
    await asyncio.sleep(0.3)  # six ticks at 20 Hz
    unwatched = sources.reads - slowed
    pipe = Pipe(subscribe(20.0))
    asked = time.monotonic()
    serving = asyncio.create_task(hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain))
    await _until(lambda: sum(f.type == protocol.SAMPLE for f in pipe.frames()) >= 5, "samples")
    took = time.monotonic() - asked
    pipe.incoming.put_nowait(b"")
    await serving
    runner.cancel()
    return slowed, unwatched, pipe.frames(), took, sources.brief


def test_an_unwatched_quiet_box_is_sampled_slowly_until_someone_subscribes() -> None:
    slowed, unwatched, frames, took, brief = asyncio.run(_quiet_then_watched())
    # A tick or two at the full rate before the first verdict comes back, then none.
    assert slowed <= 3 and unwatched == 0
    samples = [f.body for f in frames if f.type == protocol.SAMPLE]
    # The subscriber is not left with the quiet box's stale sample for an hour: it gets
    # fresh ones at its rate, numbered after the last quiet one.
    assert samples[0]["seq"] > slowed and took < 5.0
    assert [s["seq"] for s in samples] == sorted({s["seq"] for s in samples})
    # Ticks at the full rate read everything; those a watcher gets too.
    assert not any(brief[: slowed - 1]) and not any(brief[slowed:])


async def _hurried() -> tuple[int, int]:
    sources = CountingSources()
    hub = _quiet_hub(sources, quiet_interval=3600.0)
    runner = asyncio.create_task(hub.run())
    await _until(lambda: hub.slow and sources.reads >= 1, "the sampler to slow down")
    before = sources.reads
    hub.hurry()  # someone typed in the box
    await _until(lambda: sources.reads > before, "a tick after hurry()")
    runner.cancel()
    return before, sources.reads


def test_use_brings_a_tick_at_once() -> None:
    before, after = asyncio.run(_hurried())
    assert after > before


async def _brief_ticks() -> list[bool]:
    sources = CountingSources()
    # Quiet ticks as often as full ones: only what they read differs.
    hub = _quiet_hub(sources, quiet_interval=0.05)
    runner = asyncio.create_task(hub.run())
    await _until(lambda: sources.brief.count(True) >= 3, "three quiet ticks")
    pipe = Pipe(subscribe(20.0))
    serving = asyncio.create_task(hub.serve(read=pipe.read, write=pipe.write, drain=pipe.drain))
    await _until(lambda: sum(f.type == protocol.SAMPLE for f in pipe.frames()) >= 3, "samples")
    watched = list(sources.brief)  # while the subscriber is there
    pipe.incoming.put_nowait(b"")
    await serving
    runner.cancel()
    return watched


def test_quiet_ticks_nobody_watches_read_briefly() -> None:
    brief = asyncio.run(_brief_ticks())
    assert brief[0] is False  # the first tick, before any verdict
    first_brief = brief.index(True)
    assert all(brief[first_brief : first_brief + 3])
    assert brief[-1] is False  # a watcher's samples are whole


async def _never_quiet() -> int:
    sources = CountingSources()
    hub = Telemetry(box="b", open_sources=lambda: sources, base_rate=20.0, quiet=lambda: False)
    runner = asyncio.create_task(hub.run())
    await _until(lambda: sources.reads >= 6, "six ticks at the full rate", timeout=10.0)
    runner.cancel()
    return sources.reads


def test_a_box_that_is_not_quiet_keeps_its_rate() -> None:
    assert asyncio.run(_never_quiet()) >= 6


# --- when the box is quiet -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "time", c)  # the activity record's clock (time.time)
    return c


def _gpu(util: float, power_w: float = 300.0) -> GpuSample:
    return {
        "index": 0,
        "uuid": "GPU-0",
        "name": "sim",
        "lost": False,
        "util": util,
        "mem_util": 0.0,
        "mem_used": 0,
        "mem_total": 1,
        "power_w": power_w,
        "power_limit_w": 700.0,
        "temp_c": 40.0,
        "sm_clock_mhz": None,
        "pcie_tx_kbs": None,
        "pcie_rx_kbs": None,
        "ecc_corrected": None,
        "ecc_uncorrected": None,
        "processes": [],
    }


def _sample(t: float, util: float = 0.0, cpu: float = 0.0, power_w: float = 300.0) -> Any:
    proc = {"pid": 1, "ppid": 0, "name": "bash", "cmdline": "bash", "user": "me"}
    proc |= {"cpu": cpu, "rss": 1, "threads": 1}
    return {"t": t, "seq": 1, "gpus": [_gpu(util, power_w)], "host": HOST, "processes": [proc]}


def test_a_box_is_quiet_once_nothing_happened_for_a_while(clock: Clock) -> None:
    used: list[float] = []
    activity = Activity(None)
    activity.on_use = lambda: used.append(clock.now)
    activity.observe(_sample(clock.now))
    assert not activity.quiet()  # it just started: that counts as use
    clock.now += QUIET_AFTER
    activity.observe(_sample(clock.now, util=1.0, cpu=0.5))  # a GPU at 1%, a shell's 0.5%
    assert activity.quiet()
    # A key in a session: not quiet, and the sampler is told at once.
    activity.keys(1)
    assert not activity.quiet() and used == [clock.now]
    clock.now += QUIET_AFTER
    assert activity.quiet()


@pytest.mark.parametrize(
    "busy",
    [
        {"util": 50.0},  # a GPU at work
        {"cpu": 80.0},  # a CPU job in the box
    ],
)
def test_load_keeps_the_box_from_quiet_for_a_while_after(clock: Clock, busy: Any) -> None:
    activity = Activity(None)
    clock.now += QUIET_AFTER
    activity.observe(_sample(clock.now, **busy))
    assert not activity.quiet()
    clock.now += QUIET_AFTER - 1
    activity.observe(_sample(clock.now))
    assert not activity.quiet()
    clock.now += 1
    activity.observe(_sample(clock.now))
    assert activity.quiet()


def test_a_run_a_probe_step_or_a_stall_keep_the_box_from_quiet(clock: Clock) -> None:
    activity = Activity(None, rule=hang.Rule(util=90, power=30, after=600))
    clock.now += QUIET_AFTER
    activity.set_runs(1)
    assert not activity.quiet()
    activity.set_runs(0)
    assert activity.quiet()
    activity.probe()
    assert not activity.quiet()
    clock.now += QUIET_AFTER
    assert activity.quiet()
    # GPUs busy at low power: stalled, and judged on every 1 Hz sample, not quiet ticks.
    activity.observe(_sample(clock.now, util=100.0, power_w=50.0))
    assert activity.stalled_since and not activity.quiet()
