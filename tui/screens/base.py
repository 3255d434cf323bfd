"""What every dashboard screen shares: a typed handle on the app that owns the workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen

if TYPE_CHECKING:
    from tui.app import DevboxApp


class AppScreen(Screen[None]):
    @property
    def devbox(self) -> DevboxApp:
        return self.app  # type: ignore[return-value]
