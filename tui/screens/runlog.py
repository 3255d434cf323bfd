"""The end of one run's log, refreshed while the screen is open (the app's worker fetches it)."""

from __future__ import annotations

import re
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Footer, Header, Log

from tui import messages
from tui.screens.base import AppScreen, ScreenContext

# Colours and cursor moves a terminal would interpret; a log view shows text.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")


class RunLogScreen(AppScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("a", "attach", "Attach"),
    ]

    def __init__(self, context: ScreenContext, box: str, run_id: str) -> None:
        super().__init__(context)
        self.box_name = box
        self.run_id = run_id
        self.text: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Log(id="log", highlight=False)
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"run {self.run_id} on {self.box_name}"

    def show_log(self, text: str) -> None:
        if text == self.text:
            return
        log = self.query_one("#log", Log)
        # The tail moves as the run writes: redraw it whole; a terminal's carriage
        # returns (progress bars) keep only what they last drew.
        plain = _ESCAPES.sub("", text).replace("\r\n", "\n")
        lines = [line.rsplit("\r", 1)[-1] for line in plain.split("\n")]
        log.clear()
        log.write_lines(lines)
        self.text = text

    def action_attach(self) -> None:
        self.app.post_message(messages.AttachRun(self.box_name, self.run_id))
