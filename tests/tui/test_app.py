"""The dashboard's behaviour, driven by Textual's Pilot against a made-up feed: what the
user does (filter, open, claim, release, enter) and what the app does by itself
(redraw only what changed, reconnect a lost stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from textual.widgets import DataTable, Input, Sparkline, Static

from devbox import protocol
from devbox.boxes import Box
from tests.tui.synthetic import T0, SyntheticFeed
from tui.app import DevboxApp, make_app
from tui.screens.box import BoxScreen, GpuPanel
from tui.screens.boxes import BoxesScreen
from tui.screens.modals import ClaimScreen, ConfirmScreen
from tui.widgets.boxtable import BoxTable

SIZE = (140, 40)


def app_for(feed: SyntheticFeed, **options: Any) -> DevboxApp:
    return make_app(feed=feed, clock=lambda: T0, list_interval=0.2, **options)


def notifications(app: DevboxApp) -> list[str]:
    """What the app will tell the user through notify (toasts), in order, as it says it."""
    said: list[str] = []
    real = app.notify

    def spy(message: str, **kwargs: object) -> None:
        said.append(message)
        real(message, **kwargs)  # type: ignore[arg-type]

    app.notify = spy  # type: ignore[method-assign]
    return said


def link_states(app: DevboxApp, box: str) -> list[str]:
    """Every link state the store records for `box` from now on, in order."""
    states: list[str] = []
    real = app.store.link

    def record(name: str, state: str) -> None:
        if name == box:
            states.append(state)
        real(name, state)

    app.store.link = record  # type: ignore[method-assign]
    return states


async def until(condition: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def boxes_screen(app: DevboxApp) -> BoxesScreen:
    assert isinstance(app.screen, BoxesScreen), app.screen
    return app.screen


def cell(app: DevboxApp, name: str, column: str) -> str:
    return app.screen.query_one("#boxes", BoxTable).cell(name, column)


async def test_boxes_show_live_telemetry() -> None:
    app = app_for(SyntheticFeed(3, 2), rate=20)
    async with app.run_test(size=SIZE):
        await until(lambda: len(boxes_screen(app).shown) == 3)
        await until(lambda: all(v.link == "live" for v in app.store.views.values()))
        assert boxes_screen(app).shown == ["box-00", "box-01", "box-02"]
        assert cell(app, "box-01", "STATE") == "running"
        assert cell(app, "box-01", "GPU MEM") == "41.0G/160.0G"
        assert cell(app, "box-01", "AGE") == "1h"
        # The sparkline spans the history the stream replayed first.
        assert len(cell(app, "box-01", "GPU UTIL").strip()) == 16
        detail = str(app.screen.query_one("#detail", Static).render())
        assert "box-00" in detail and "GPU 1 Simulated H100" in detail


async def test_filter_narrows_and_escape_restores() -> None:
    app = app_for(SyntheticFeed(12, 1))
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 12)
        await pilot.press("slash", "1", "1")
        assert app.screen.query_one("#filter", Input).has_focus
        assert boxes_screen(app).shown == ["box-11"]
        await pilot.press("escape")
        assert len(boxes_screen(app).shown) == 12
        assert app.screen.query_one("#boxes", BoxTable).has_focus


async def test_open_a_box_shows_a_chart_per_gpu_and_escape_goes_back() -> None:
    app = app_for(SyntheticFeed(2, 4), rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await pilot.press("j", "enter")
        assert isinstance(app.screen, BoxScreen) and app.screen.box_name == "box-01"
        await until(lambda: len(app.screen.query(GpuPanel)) == 4)
        await until(lambda: len(app.screen.query_one("#gpu-3-util", Sparkline).data or []) >= 60)
        procs = app.screen.query_one("#procs", DataTable)
        await until(lambda: procs.row_count == 5)
        assert app.screen.query_one("#gpu-procs", DataTable).row_count == 4
        await pilot.press("escape")
        assert isinstance(app.screen, BoxesScreen)


async def test_redraw_touches_only_boxes_that_changed() -> None:
    feed = SyntheticFeed(3, 1, live=False)
    app = app_for(feed)
    async with app.run_test(size=SIZE):
        await until(lambda: all(v.sample for v in app.store.views.values()))
        await asyncio.sleep(0.3)
        table = app.screen.query_one("#boxes", BoxTable)
        updated: list[object] = []
        real = table.update_rows

        def spy(rows: Mapping[str, tuple[str, ...]]) -> None:
            updated.extend(rows)
            real(rows)

        table.update_rows = spy  # type: ignore[method-assign]
        app.store.link("box-01", "lost: test")
        await until(lambda: bool(updated))
        await asyncio.sleep(0.3)
        assert set(updated) == {"box-01"}
        assert cell(app, "box-01", "STATE") == "lost"


async def test_a_burst_of_samples_is_drawn_once() -> None:
    app = app_for(SyntheticFeed(1, 1, live=False), redraw_hz=2)
    async with app.run_test(size=SIZE):
        await until(lambda: app.store.views.get("box-00") and app.store.views["box-00"].sample)
        calls: list[set[str]] = []
        screen = boxes_screen(app)
        real = screen.show

        def spy(store: object, dirty: set[str], *, relist: bool) -> None:
            calls.append(set(dirty))
            real(store, dirty, relist=relist)  # type: ignore[arg-type]

        screen.show = spy  # type: ignore[method-assign]
        view = app.store.views["box-00"]
        assert view.sample is not None
        for seq in range(100):  # 100 samples inside one redraw period
            app.store.frame("box-00", _sample_frame(view.sample, seq))
        await until(lambda: bool(calls), timeout=3)
        await asyncio.sleep(0.6)
        assert calls == [{"box-00"}]
        assert view.sample["seq"] == 99


def _sample_frame(base: protocol.Sample, seq: int) -> protocol.Frame:
    return protocol.Frame(protocol.SAMPLE, {**base, "seq": seq})


async def test_a_lost_stream_shows_and_reconnects_by_itself() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed, rate=20)
    async with app.run_test(size=SIZE):
        await until(lambda: app.store.views.get("box-01") and app.store.views["box-01"].sample)
        states = link_states(app, "box-01")
        feed.fail_next_stream.add("box-01")
        await until(lambda: any(s.startswith("lost:") for s in states))
        await until(lambda: app.store.views["box-01"].link == "live")
        assert "lost: lost the connection to box box-01: injected" in states
        assert app.store.views["box-00"].link == "live"  # the other box never noticed


async def test_claim_validates_then_claims() -> None:
    feed = SyntheticFeed(1, 1)
    app = app_for(feed)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 1)
        await pilot.press("c")
        assert isinstance(app.screen, ClaimScreen)
        await pilot.press(*"Bad_Name", "enter")
        error = str(app.screen.query_one("#error").render())
        assert "invalid box name 'Bad_Name'" in error
        assert isinstance(app.screen, ClaimScreen)  # still open, nothing claimed
        app.screen.query_one("#name", Input).value = "fresh"
        app.screen.query_one("#gpus", Input).value = "2"
        await pilot.press("enter")
        await until(lambda: "fresh" in boxes_screen(app).shown)
        assert [b.spec.gpus for b in feed.box_list if b.name == "fresh"] == [2]


async def test_release_asks_first() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await pilot.press("ctrl+d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert len(feed.box_list) == 2
        await pilot.press("ctrl+d", "y")
        await until(lambda: boxes_screen(app).shown == ["box-01"])
        assert [b.name for b in feed.box_list] == ["box-01"]


async def test_help_and_quit() -> None:
    app = app_for(SyntheticFeed(1, 1))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert app.screen.query("HelpPanel")
        await pilot.press("question_mark")
        assert not app.screen.query("HelpPanel")
        await pilot.press("q")
    assert app.return_code == 0


async def test_keep_holds_the_selected_box() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await pilot.press("j", "K")
        await until(lambda: app.store.views["box-01"].box.keep_until > 0)
        assert app.store.views["box-01"].box.keep_until == T0 + 4 * 3600
        assert app.store.views["box-00"].box.keep_until == 0
        await until(lambda: "kept until" in str(app.screen.query_one("#detail").render()))


def test_entering_a_box_passes_on_the_dashboards_cluster_flags() -> None:
    from devbox.backends.local import LocalBackend
    from devbox.config import Config
    from tests.tui.synthetic import make_box
    from tui.feed import BackendFeed

    feed = BackendFeed(LocalBackend(config=Config()), cli_flags=["--namespace=lab"])
    argv = feed.enter_argv(make_box(0, 1))
    assert argv[-5:] == ["ssh", "--backend", "local", "--namespace=lab", "box-00"]


async def test_a_reconnect_uses_the_boxs_newest_record() -> None:
    import dataclasses

    from devbox.errors import DevboxError

    class Moving(SyntheticFeed):
        """Reachable only at the address of its newest record (port 2)."""

        async def stream(self, box: Box, *, rate: float) -> AsyncIterator[protocol.Frame]:
            if box.port != 2:
                raise DevboxError(f"cannot reach box {box.name}")
            async for frame in super().stream(box, rate=rate):
                yield frame

    feed = Moving(1, 1)
    app = app_for(feed, rate=20)
    async with app.run_test(size=SIZE):
        await until(lambda: "box-00" in app.store.views)
        await until(lambda: app.store.views["box-00"].link.startswith("lost:"))
        feed.box_list = [dataclasses.replace(feed.box_list[0], port=2)]  # the agent moved
        await until(lambda: app.store.views["box-00"].link == "live", timeout=10)


async def test_the_autoscalers_warning_and_health_mark_show() -> None:
    import dataclasses

    feed = SyntheticFeed(3, 1)
    feed.box_list[1] = dataclasses.replace(
        feed.box_list[1], release_at=T0 + 240, release_reason="idle"
    )
    feed.box_list[2] = dataclasses.replace(feed.box_list[2], unhealthy_since=T0 - 300)
    app = app_for(feed)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 3)
        assert [cell(app, f"box-0{i}", "STATE") for i in range(3)] == [
            "running",
            "warned",
            "unhealthy",
        ]
        await pilot.press("j")
        await until(
            lambda: "released in 4m" in str(app.screen.query_one("#detail", Static).render())
        )
        detail = str(app.screen.query_one("#detail", Static).render())
        assert "idle: released in 4m unless used (or `devbox keep box-01`)" in detail
        await pilot.press("enter")
        assert isinstance(app.screen, BoxScreen)
        summary = app.screen.query_one("#summary", Static)
        await until(lambda: "released in 4m" in str(summary.render()))
        await pilot.press("escape", "j", "enter")
        assert isinstance(app.screen, BoxScreen) and app.screen.box_name == "box-02"
        summary = app.screen.query_one("#summary", Static)
        await until(lambda: "unhealthy: agent silent for 5m" in str(summary.render()))


async def test_a_hung_box_shows_and_a_release_says_what_was_saved() -> None:
    import dataclasses

    feed = SyntheticFeed(2, 1)
    # The list says it (a few seconds behind), then the box's own samples.
    feed.box_list[1] = dataclasses.replace(feed.box_list[1], hung_since=T0 - 600)
    feed.hung["box-01"] = T0 - 600
    feed.saved["box-01"] = [
        {"pid": 42, "cmd": "python train.py", "status": "saved", "saved": ["ckpt.pt"], "detail": ""}
    ]
    app = app_for(feed)
    told = notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await until(lambda: cell(app, "box-01", "STATE") == "hung")
        assert cell(app, "box-00", "STATE") == "running"
        await until(lambda: any("box box-01 looks hung" in n for n in told))
        await pilot.press("j")
        detail = app.screen.query_one("#detail", Static)
        await until(lambda: "hung for 10m" in str(detail.render()))
        assert "devbox probe box-01 --stacks" in str(detail.render())
        await pilot.press("ctrl+d", "y")
        await until(lambda: any("saved ckpt.pt" in n for n in told))
        said = [n for n in told if "released" in n]
        assert said and "process 42 (python train.py) saved ckpt.pt" in said[-1], said


def test_entering_a_box_of_one_of_several_clusters_names_its_cluster() -> None:
    """A child `devbox ssh` goes straight to the box's cluster, not asking every one."""
    import dataclasses

    from devbox.backends.local import LocalBackend
    from devbox.config import Config
    from tests.tui.synthetic import make_box
    from tui.feed import BackendFeed

    feed = BackendFeed(LocalBackend(config=Config()))
    box = dataclasses.replace(make_box(0, 1), cluster="onprem")
    assert feed.enter_argv(box)[-4:] == ["local", "--cluster", "onprem", "box-00"]
    assert feed.attach_argv(box, "r1")[-5:] == ["local", "--cluster", "onprem", "box-00", "r1"]


async def test_a_cluster_that_does_not_answer_is_said_beside_the_others_boxes() -> None:
    feed = SyntheticFeed(2, 1)
    feed.problem_list = ["cluster cloud is unreachable: no answer within 1.5s"]
    app = app_for(feed)
    async with app.run_test(size=SIZE):
        await until(lambda: len(boxes_screen(app).shown) == 2)
        await until(lambda: "cluster cloud is unreachable" in str(boxes_screen(app).sub_title))
        assert str(boxes_screen(app).sub_title).startswith("2 boxes; ")
        feed.problem_list = []  # it answers again: the title says so at the next look
        await until(lambda: boxes_screen(app).sub_title == "2 boxes")


async def test_more_boxes_than_lines_scroll_down_but_never_sideways() -> None:
    """A table taller than the screen gets a vertical scrollbar; its lines are cut to the
    width left beside it, so there is nothing to scroll sideways to (a horizontal bar used
    to appear, and took a line)."""
    app = app_for(SyntheticFeed(50, 1), rate=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(lambda: len(boxes_screen(app).shown) == 50)
        await pilot.pause()
        table = app.screen.query_one("#boxes", BoxTable)
        assert table.show_vertical_scrollbar
        assert not table.show_horizontal_scrollbar
        assert table.virtual_size.width <= table.scrollable_content_region.width
