"""The dashboard against real local boxes: real agents with the simulated GPUs, claimed,
watched and released through the app, and a real terminal for entering a box's session
and for quitting cleanly."""

from __future__ import annotations

import json
import os
import sys

import pytest

from devbox.backends.local import LocalBackend
from devbox.config import Config
from tests import nvml_sim
from tests.conftest import PROMPT, User
from tests.terminal import Terminal
from tests.tui.test_app import until
from tui.app import make_app
from tui.screens.box import BoxScreen, GpuPanel
from tui.screens.boxes import BoxesScreen
from tui.screens.modals import ClaimScreen

DEVBOX = f"{sys.executable} -m devbox"


@pytest.fixture
def as_user(user: User, monkeypatch: pytest.MonkeyPatch) -> User:
    """This process acts as `user` (its HOME, state, GPU locks and simulated NVML), so the
    app's backend and the agents it starts are that user's."""
    for key in [k for k in os.environ if k.startswith(("XDG_", "DEVBOX_"))]:
        monkeypatch.delenv(key)
    for key, value in user.env.items():
        monkeypatch.setenv(key, value)
    return user


async def test_claim_watch_and_release_a_real_box(as_user: User) -> None:
    nvml_sim.write(as_user.gpu_file, [nvml_sim.SimGpu(util=63, temp=55) for _ in range(2)])
    app = make_app(backend=LocalBackend(config=Config()), rate=5.0, list_interval=0.5)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.press("c")
        assert isinstance(app.screen, ClaimScreen)
        await pilot.press(*"tuibox")
        await pilot.press("tab")
        await pilot.press("backspace", "1", "enter")
        await until(lambda: "tuibox" in app.store.views, timeout=30)
        view = app.store.views["tuibox"]
        await until(lambda: view.link == "live" and view.sample is not None, timeout=30)
        assert view.sample is not None
        (gpu,) = view.sample["gpus"]  # the one GPU it claimed, as the simulated driver says
        assert (gpu["util"], gpu["temp_c"]) == (63, 55)
        assert isinstance(app.screen, BoxesScreen) and app.screen.shown == ["tuibox"]

        await pilot.press("enter")
        assert isinstance(app.screen, BoxScreen)
        await until(lambda: len(app.screen.query(GpuPanel)) == 1)
        await pilot.press("ctrl+d", "y")
        await until(lambda: isinstance(app.screen, BoxesScreen), timeout=30)
        await until(lambda: "tuibox" not in app.store.views, timeout=30)
    listed = json.loads(as_user.devbox("ls", "--json", check=True).stdout)
    assert listed == []
    assert (as_user.box_dir("tuibox") / "home").is_dir()  # released, home kept


def test_enter_a_box_and_come_back_then_quit_cleanly(user: User, term: Terminal) -> None:
    user.up("entered")
    target = term.start(f"{DEVBOX} tui")
    term.wait_for(target, "entered")
    term.wait_for(target, "running")
    term.send(target, "s")  # the app suspends; the box's screen session takes the terminal
    term.wait_for(target, PROMPT)
    term.type(target, "echo inside-$DEVBOX_BOX")
    term.wait_for(target, "inside-entered")
    term.send(target, "C-a", "d")  # detach from screen: back to the dashboard
    shown = term.wait_for(target, "NAME")
    assert "WHERE" in shown and "entered" in shown
    term.send(target, "q")
    shown = term.wait_for(target, "EXIT=0")
    # The terminal is back in its normal state: the main screen (what was printed before
    # the app is there again) and cooked mode with echo (what is typed shows up).
    assert "[detached from" in shown
    term.send(target, "-l", "typed-after-quit")
    term.wait_for(target, "typed-after-quit")


def test_tui_bad_input(user: User) -> None:
    result = user.devbox("tui", "--rate", "0")
    assert result.returncode == 2 and result.stderr.startswith(b"devbox: error:")
    result = user.devbox("tui", "--backend", "nowhere")
    assert result.returncode == 2 and result.stderr.count(b"\n") == 1
