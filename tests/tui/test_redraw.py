"""What a redraw repaints: the lines of rows that changed and are on screen, nothing for a
row whose values came again unchanged, the detail only when its text changed; and the
caches behind that (sparklines, the GC's threshold while the app runs) never show stale."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Static

from devbox import protocol
from tests.tui.synthetic import T0, SyntheticFeed, make_box, sample
from tests.tui.test_app import SIZE, app_for, boxes_screen, until
from tui import app as app_module
from tui.feed import BoxView
from tui.screens import boxes as boxes_module
from tui.screens.boxes import Rows, Sparks, row
from tui.widgets.boxtable import BoxTable
from tui.widgets.text import spark

COLUMNS = ("NAME", "VALUE")


class _TableApp(App[None]):
    """A table of `rows` rows above a 3-line panel, in a 40x10 terminal: 7 rows show."""

    CSS = "#below { height: 3; }"

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = BoxTable(COLUMNS, id="t")
        self.first = [(f"r{i:02d}", (f"r{i:02d}", "0")) for i in range(rows)]

    def compose(self) -> ComposeResult:
        yield self.table
        yield Static("below", id="below")

    def on_mount(self) -> None:
        self.table.set_rows(self.first)


def _frames(app: App[Any]) -> list[set[int]]:
    """The screen lines each frame from now on sends to the terminal."""
    from textual._compositor import ChopsUpdate, LayoutUpdate

    frames: list[set[int]] = []
    real = app._display

    def display(screen: Any, update: Any) -> None:
        real(screen, update)
        if isinstance(update, ChopsUpdate):
            frames.append({y for y, _, _ in update.spans})
        elif isinstance(update, LayoutUpdate):
            frames.append(set(range(update.region.y, update.region.bottom)))

    app._display = display  # type: ignore[method-assign,assignment]
    return frames


def _rendered(table: BoxTable) -> list[int]:
    """The table's lines drawn anew (not from its cache) from now on."""
    lines: list[int] = []
    real = table.render_line

    def render_line(y: int) -> Any:
        lines.append(y)
        return real(y)

    table.render_line = render_line  # type: ignore[method-assign]
    return lines


async def test_a_changed_row_is_repainted_and_an_unchanged_one_is_not() -> None:
    app = _TableApp(4)
    async with app.run_test(size=(40, 10)) as pilot:
        await until(lambda: app.table.size.height > 0 and app.table.keys)
        await pilot.pause()
        drawn = _rendered(app.table)
        app.table.update_rows({"r01": ("r01", "0"), "r02": ("r02", "7")})
        await until(lambda: 2 in drawn)
        assert drawn == [2]
        assert app.table.cell("r02", "VALUE") == "7"


async def test_a_change_to_a_row_scrolled_out_of_view_sends_nothing() -> None:
    app = _TableApp(20)
    async with app.run_test(size=(40, 10)) as pilot:
        await until(lambda: app.table.size.height > 0 and app.table.keys)
        await pilot.pause()
        bottom = app.table.region.bottom  # the panel below starts here
        hidden = f"r{app.table.size.height + 1:02d}"  # the second row below those that show
        frames = _frames(app)
        app.table.update_rows({hidden: (hidden, "7"), "r00": ("r00", "7")})
        await until(lambda: frames)
        # Its region fell on the panel's lines (the table's clip is the screen), and so
        # they were sent again, unchanged.
        assert frames[0] == {app.table.region.y}, (frames[0], bottom)
        assert app.table.cell(hidden, "VALUE") == "7"  # and it shows once scrolled to
        app.table.action_jump(app.table.size.height + 1)
        await until(lambda: any(bottom - 1 in f for f in frames[1:]))


async def test_the_detail_is_repainted_only_when_its_text_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(boxes_module, "DETAIL_HZ", 1e9)  # no rate limit: every redraw
    app = app_for(SyntheticFeed(2, 1, live=False))
    async with app.run_test(size=SIZE):
        await until(lambda: all(v.sample for v in app.store.views.values()) and app.store.views)
        screen = boxes_screen(app)
        detail = screen.query_one("#detail", Static)
        await until(lambda: "GPU 0" in str(detail.render()))
        updates: list[object] = []
        looked: list[object] = []
        real_update, real_show_detail = detail.update, screen.show_detail

        def update(*args: Any, **kwargs: Any) -> None:
            updates.append(args)
            real_update(*args, **kwargs)

        def show_detail(**kwargs: Any) -> None:
            looked.append(kwargs)
            real_show_detail(**kwargs)

        detail.update = update  # type: ignore[method-assign]
        screen.show_detail = show_detail  # type: ignore[method-assign]
        app.store.dirty.add("box-00")  # its sample came again, the same values
        await until(lambda: looked)
        assert updates == []
        app.store.link("box-00", "lost: test")
        await until(lambda: updates)
        assert "telemetry: lost: test" in str(detail.render())


def test_the_cached_sparkline_is_the_one_drawn_afresh() -> None:
    view, sparks = BoxView(make_box(0, 2)), Sparks()
    view.add_history([sample(0, 2, s, t=T0 - 30 + s) for s in range(30)])
    assert sparks.of(view) == spark(view.util)
    for seq in range(40):  # 10 Hz: a history point every tenth sample
        view.add(sample(0, 2, 100 + seq, t=T0 + seq / 10))
        assert sparks.of(view) == spark(view.util), seq
    # A box that went and came back under the same name starts its history anew.
    again = BoxView(make_box(0, 2))
    again.add(sample(0, 2, 0, t=T0))
    assert sparks.of(again) == spark(again.util)


def test_cached_rows_are_the_rows_formatted_afresh() -> None:
    """Whatever a row shows changes (a sample's figures, the record, the link, the clock,
    the history) and the cache gives what `row` gives."""
    import dataclasses

    from devbox.boxes import BoxState

    view, rows = BoxView(make_box(1, 2)), Rows()
    view.add_history([sample(1, 2, s, t=T0 - 30 + s) for s in range(30)])
    now = T0

    def same() -> None:
        assert rows.of(view, now) == row(view, now)

    same()
    still = sample(1, 2, 7, t=T0)
    for seq in range(25):  # the same figures again and again, then new ones
        view.add({**(still if seq < 15 else sample(1, 2, seq, t=T0)), "t": T0 + seq / 10})
        # The idle time ticks (box 1 was last active 30 s before T0), out of step with
        # the history's points.
        now += 0.13
        same()
    view.link = "lost: test"
    same()
    view.box = dataclasses.replace(view.box, state=BoxState.IDLE)
    same()
    now += 3600
    same()


async def test_the_gc_threshold_is_raised_while_the_app_runs_and_restored_after() -> None:
    before = gc.get_threshold()
    app = app_for(SyntheticFeed(1, 1))
    async with app.run_test(size=SIZE):
        assert gc.get_threshold()[0] >= app_module.GC_YOUNG_THRESHOLD
        assert gc.get_threshold()[1:] == before[1:]
    assert gc.get_threshold() == before


def test_a_still_feed_repeats_its_values() -> None:
    """The benchmark's idle lab: the same values, time and sequence moving on."""
    import asyncio

    async def two() -> list[protocol.Sample]:
        feed = SyntheticFeed(1, 2, history=3, still=True)
        got: list[protocol.Sample] = []
        async for frame in feed.stream(feed.box_list[0], rate=1000):
            if frame.type == protocol.SAMPLE:
                got.append(protocol.sample(frame))
                if len(got) == 2:
                    return got
        return got

    a, b = asyncio.run(two())
    assert (a["seq"], b["seq"]) == (3, 4) and a["t"] < b["t"]
    assert a["gpus"] == b["gpus"] and a["host"] == b["host"]
