"""What every dashboard screen shares: the app's store and clock, handed in at
construction (the screens never reach for the app; they post tui.messages to it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.screen import Screen

from tui.feed import Store


@dataclass(frozen=True)
class ScreenContext:
    store: Store
    clock: Callable[[], float]  # ages and idle times; tests fix it for snapshots


class AppScreen(Screen[None]):
    def __init__(self, context: ScreenContext) -> None:
        super().__init__()
        self.context = context

    def show(self, store: Store, dirty: set[str], *, relist: bool) -> None:
        """Repaint what changed since the last redraw (the app's redraw clock calls it)."""
