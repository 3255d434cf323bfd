"""The model screen (devbox.probe) in the dashboard, against the made-up feed: live layer
statistics with sparklines, the selected layer's histogram over time, and alerts."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import DataTable, Static

from tests.tui.synthetic import LAYERS, SyntheticFeed
from tests.tui.test_app import SIZE, app_for, boxes_screen, until
from tests.tui.test_snapshots import check
from tui.screens.box import BoxScreen
from tui.screens.model import ModelScreen, heat


def text(app: object, selector: str) -> str:
    return str(app.screen.query_one(selector, Static).render())  # type: ignore[attr-defined]


async def test_model_screen_shows_layers_histograms_and_alerts() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed, rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await pilot.press("enter")
        assert isinstance(app.screen, BoxScreen)
        await pilot.press("m")
        assert isinstance(app.screen, ModelScreen) and app.screen.box_name == "box-00"
        table = app.screen.query_one("#layers", DataTable)
        await until(lambda: table.row_count == LAYERS)
        assert table.get_row_at(0)[:2] == ["4242", "layer0"]
        # The gradient-norm sparkline fills as reports come.
        await until(lambda: len(str(table.get_row_at(0)[9]).strip()) >= 3)
        # The selected layer's histogram is asked for, and shown over time.
        await until(lambda: feed.requests and "step" in text(app, "#histogram"), timeout=8)
        assert feed.requests[0]["layer"] == "layer0" and feed.requests[0]["pid"] == 4242
        await pilot.press("down")
        await until(lambda: any(r["layer"] == "layer1" for r in feed.requests), timeout=8)
        await until(lambda: text(app, "#histogram").startswith("layer1"), timeout=8)
        assert "no alerts" in text(app, "#alerts")
        model = app.store.models["box-00"]
        feed.nan_at = (max(s["step"] for s in model.stats.values()) // 10 + 5) * 10
        await until(lambda: "ALERT nan" in text(app, "#alerts"), timeout=8)
        assert table.get_row_at(0)[7] != "0"  # the NaN/Inf count
        await pilot.press("escape")
        assert isinstance(app.screen, BoxScreen)
        await until(lambda: "box-00" not in app.probes)  # the stream ends with the screen


def test_heat_row() -> None:
    assert heat([0, 1, 2, 4], 4) == " ░▒█"
    assert heat([], 5) == "" and len(heat([1] * 100, 40)) == 40


async def test_model_screen_snapshot(tmp_path: Path) -> None:
    feed = SyntheticFeed(1, 1, live=False)
    app = app_for(feed)
    async with app.run_test(size=(120, 34)) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 1)
        app.open_model("box-00")
        await until(lambda: isinstance(app.screen, ModelScreen) and app.screen.query("#layers"))
        table = app.screen.query_one("#layers", DataTable)
        await until(lambda: table.row_count == LAYERS and "no alerts" in text(app, "#alerts"))
        # The footer lays out its keys on its own schedule; a loaded machine shows that.
        await until(lambda: len(app.screen.query("FooterKey")) > 0)
        await pilot.pause(0.5)
        svg = app.export_screenshot(title="devbox tui")
    check(svg, "model.svg", tmp_path)
