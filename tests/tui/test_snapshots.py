"""SVG snapshots of the two main screens at a fixed size, with fixed made-up telemetry and
a fixed clock. After an intended change of the look, refresh them with
`DEVBOX_UPDATE_SNAPSHOTS=1 pytest tests/tui/test_snapshots.py` and review the diff (the
README shows these same files)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from tests.tui.synthetic import SyntheticFeed
from tests.tui.test_app import app_for, until
from tui.app import DevboxApp
from tui.screens.box import GpuPanel

SNAPSHOTS = Path(__file__).with_name("snapshots")
SIZE = (120, 34)


def check(svg: str, name: str, tmp_path: Path) -> None:
    expected = SNAPSHOTS / name
    if os.environ.get("DEVBOX_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.mkdir(exist_ok=True)
        expected.write_text(svg)
        return
    if not expected.exists():
        pytest.fail(f"no snapshot {expected}; run with DEVBOX_UPDATE_SNAPSHOTS=1 to make it")
    if svg != expected.read_text():
        actual = tmp_path / name
        actual.write_text(svg)
        pytest.fail(f"{name} differs from its snapshot; this run's picture is {actual}")


async def settled(app: DevboxApp, pilot: Pilot[None], timeout: float = 10.0) -> str:
    """The screen's picture once two in a row are the same: the feed is not live, so it
    stops changing when the last layout and refresh are done (sooner or later on a loaded
    machine), and a fixed pause would sometimes catch it half drawn."""
    deadline = asyncio.get_running_loop().time() + timeout
    before = app.export_screenshot(title="devbox tui")
    while True:
        await pilot.pause(0.1)
        now = app.export_screenshot(title="devbox tui")
        if now == before:
            return now
        assert asyncio.get_running_loop().time() < deadline, "the screen never settled"
        before = now


async def test_boxes_screen(tmp_path: Path) -> None:
    app = app_for(SyntheticFeed(6, 8, live=False))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(app.store.views) == 6)
        await until(lambda: all(v.sample for v in app.store.views.values()))
        await pilot.press("j", "j")
        # The footer lays out its keys on its own schedule; a loaded machine shows that.
        await until(lambda: len(app.screen.query("FooterKey")) > 0)
        svg = await settled(app, pilot)
    check(svg, "boxes.svg", tmp_path)


async def test_box_screen(tmp_path: Path) -> None:
    app = app_for(SyntheticFeed(2, 4, live=False))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: all(v.sample for v in app.store.views.values()) and app.store.views)
        await pilot.press("enter")
        await until(lambda: len(app.screen.query(GpuPanel)) == 4)
        # The runs table's rows change the scroll bar: draw once they are in.
        await until(lambda: app.screen.query_one("#runs", DataTable).row_count == 2)
        # The footer lays out its keys on its own schedule; a loaded machine shows that.
        await until(lambda: len(app.screen.query("FooterKey")) > 0)
        svg = await settled(app, pilot)
    check(svg, "box.svg", tmp_path)
