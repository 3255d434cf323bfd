"""A box whose agent sends a malformed frame (devbox.protocol's decoders refuse it) shows
that in its own row or model screen as a lost link with the reason, and reconnects; the
dashboard and the other boxes go on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from devbox import protocol
from devbox.boxes import Box
from devbox.protocol import ProbeRequest
from tests.tui.synthetic import SyntheticFeed
from tests.tui.test_app import SIZE, app_for, link_states, until


class _Garbling(SyntheticFeed):
    """Box box-01's first telemetry stream, and the first probe stream, send a frame whose
    body lacks a key its type requires; every later stream is well-formed."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.garbled: set[str] = set()

    async def stream(self, box: Box, *, rate: float) -> AsyncIterator[protocol.Frame]:
        if box.name == "box-01" and "stream" not in self.garbled:
            self.garbled.add("stream")
            yield protocol.Frame(protocol.SAMPLE, {"t": 1.0, "seq": 0, "gpus": []})
        async for frame in super().stream(box, rate=rate):
            yield frame

    async def probe(
        self, box: Box, *, outbox: asyncio.Queue[ProbeRequest]
    ) -> AsyncIterator[protocol.Frame]:
        if "probe" not in self.garbled:
            self.garbled.add("probe")
            yield protocol.Frame(protocol.PROBE_STATS, {"pid": 1, "step": 0, "watched": True})
        async for frame in super().probe(box, outbox=outbox):
            yield frame


async def test_a_malformed_sample_is_that_box_s_lost_link_and_it_reconnects() -> None:
    app = app_for(_Garbling(), rate=20)
    states = link_states(app, "box-01")
    async with app.run_test(size=SIZE):
        await until(lambda: app.store.views.get("box-01") and app.store.views["box-01"].sample)
        assert "lost: malformed sample frame: host is missing" in states
        await until(lambda: app.store.views["box-01"].link == "live")
        assert app.store.views["box-00"].link == "live"


async def test_malformed_statistics_are_the_model_screen_s_lost_link() -> None:
    app = app_for(_Garbling(), rate=20)
    async with app.run_test(size=SIZE):
        await until(lambda: app.store.views.get("box-00") and app.store.views["box-00"].sample)
        states: list[str] = []
        real_link = app.store.probe_link

        def record(name: str, state: str) -> None:
            states.append(state)
            real_link(name, state)

        app.store.probe_link = record  # type: ignore[method-assign]
        app.open_model("box-00")
        await until(lambda: app.store.models.get("box-00") and app.store.models["box-00"].stats)
        assert "lost: malformed probe-stats frame: alerts is missing" in states
