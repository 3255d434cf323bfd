"""The box screen's runs: listed with their state, a log opened, a run attached, and the end
of a run announced when the box's count of running experiments drops."""

from __future__ import annotations

import dataclasses
import re
import sys

from textual.widgets import DataTable, Log

from tests.conftest import User
from tests.terminal import Terminal
from tests.tui.synthetic import T0, SyntheticFeed
from tests.tui.test_app import SIZE, app_for, notifications, until
from tui.screens.box import BoxScreen
from tui.screens.runlog import RunLogScreen

DEVBOX = f"{sys.executable} -m devbox"


async def test_the_box_screen_lists_runs_opens_a_log_and_attaches() -> None:
    feed = SyntheticFeed(2, 1)
    app = app_for(feed, rate=20)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: len(app.store.views) == 2)
        await pilot.press("enter")
        assert isinstance(app.screen, BoxScreen)
        table = app.screen.query_one("#runs", DataTable)
        await until(lambda: table.row_count == 2)
        assert table.get_row_at(0)[:3] == ["c3d4", "running", "-"]  # newest first
        assert table.get_row_at(1)[:3] == ["a1b2", "done", "exit 0"]
        assert table.get_row_at(0)[5] == "0123456789+"  # dirty tree: a + after the commit

        await pilot.press("l")
        assert isinstance(app.screen, RunLogScreen) and app.screen.run_id == "c3d4"
        log = app.screen.query_one("#log", Log)
        await until(lambda: "epoch 1" in "\n".join(log.lines))
        # Escapes dropped; of a progress bar redrawn with \r, only what it drew last.
        assert log.lines[:3] == ["run c3d4 on box-00", "epoch 1", "step 100%"]
        await pilot.press("a")
        assert feed.attached == [("box-00", "c3d4")]
        await pilot.press("escape")
        assert isinstance(app.screen, BoxScreen)
        await pilot.press("down", "a")
        assert feed.attached[-1] == ("box-00", "a1b2")


async def test_the_end_of_a_run_is_announced() -> None:
    feed = SyntheticFeed(1, 1)
    app = app_for(feed, rate=20)
    said = notifications(app)
    async with app.run_test(size=SIZE):
        await until(lambda: app.store.run_counts.get("box-00") == 1)
        running = feed.box_runs["box-00"][1]
        feed.box_runs["box-00"][1] = dataclasses.replace(
            running, state="failed", ended_at=T0, exit_code=3
        )
        feed.running["box-00"] = 0
        await until(lambda: any("c3d4" in m for m in said))
        assert said == ["run c3d4 on box-00 failed (exit 3): python train.py --lr 1e-3"]
        await until(lambda: app.store.run_counts.get("box-00") == 0)
        assert len(said) == 1  # the old, long-finished run is not news


def test_real_runs_in_the_dashboard(user: User, term: Terminal) -> None:
    """A real box, a real run: listed, its log opened, its window attached, its end told."""
    user.up("exp")
    # The output's "tick-N" never appears in the command itself (the runs table shows it).
    ticks = "for i in $(seq 1000); do printf '%s-%d\\n' tick $i; sleep 0.2; done"
    started = user.devbox("run", "--box", "exp", "--no-sync", "-d", "--", ticks, check=True)
    run_id = started.stdout.decode().strip()
    target = term.start(f"{DEVBOX} tui")
    term.wait_for(target, "running")
    term.send(target, "Enter")
    term.wait_for(target, "Runs (l: log, a: attach)")
    # The row itself: the id alone also shows in the process list (screen's `-t run-ID`)
    # before the runs table has it, and `l` on an empty table opens nothing.
    term.wait_for(target, f"{run_id}  running")
    term.send(target, "l")
    term.wait_for(target, f"run {run_id} on exp")
    term.wait_for(target, "tick-")
    term.send(target, "Escape")
    term.wait_for(target, "Runs (l: log, a: attach)")
    term.send(target, "a")  # the app suspends; the run's screen window takes the terminal
    seen = term.wait_for(target, "tick-")
    last = max(int(n) for n in re.findall(r"tick-(\d+)", seen))
    term.wait_for(target, f"tick-{last + 2}")
    term.send(target, "C-a", "d")
    term.wait_for(target, "Runs (l: log, a: attach)")
    assert user.devbox("kill", "exp", run_id).returncode == 0
    term.wait_for(target, f"run {run_id} on exp killed (SIGTERM)", timeout=20)
    term.send(target, "q")
    term.wait_for(target, "EXIT=0")
