"""The autoscaler's release warning in the dashboard: a toast once per warning whatever
screen is open, the release clock and the key that keeps the box, and that key."""

from __future__ import annotations

import dataclasses
import time

from textual.widgets import Static

from tests.tui.synthetic import T0, SyntheticFeed
from tests.tui.test_app import SIZE, app_for, boxes_screen, notifications, until
from tui.screens.box import BoxScreen

RELEASE_AT = T0 + 240


async def test_a_new_warning_is_told_once_shown_with_its_clock_and_K_keeps_the_box() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed)
    said = notifications(app)
    clock = time.strftime("%H:%M:%S", time.localtime(RELEASE_AT))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await pilot.press("j", "enter")  # the box screen is open when the warning comes
        assert isinstance(app.screen, BoxScreen)
        feed.box_list[1] = dataclasses.replace(
            feed.box_list[1], release_at=RELEASE_AT, release_reason="idle"
        )
        await until(lambda: said)
        assert said == [
            f"box box-01 releases at {clock} unless used: K keeps it (on its row or screen)"
        ]
        summary = app.screen.query_one("#summary", Static)
        await until(lambda: f"releases at {clock} unless used: K keeps it" in str(summary.render()))
        await pilot.press("escape")
        detail = app.screen.query_one("#detail", Static)
        await until(lambda: f"releases at {clock}" in str(detail.render()))
        # Relisted many times meanwhile (every 0.2 s): told once.
        await until(lambda: app.store.views["box-01"].box.release_at == RELEASE_AT)
        assert len(said) == 1
        await pilot.press("K")
        await until(lambda: app.store.views["box-01"].box.keep_until == T0 + 4 * 3600)
        assert app.store.views["box-00"].box.keep_until == 0
