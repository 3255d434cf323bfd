"""What the autoscaler's commands need of a backend's world, beyond the loop's `World`:
the port each backend's adapter (backends/*/autoscaling.py) offers, below the backends so
that `Backend.autoscaler_world()` can name it without an import circle."""

from __future__ import annotations

from typing import Protocol

from devbox.autoscaler import policy
from devbox.autoscaler.loop import World


class Inspectable(World, Protocol):
    def settings_text(self) -> tuple[str, str] | None:
        """(TOML text, where it came from) of the backend's own settings; None: none."""
        ...

    def find(self, name: str) -> policy.BoxFacts | None:
        """One box with its activity (a few requests: for `devbox explain` only)."""
        ...

    def history(self, facts: policy.BoxFacts | None, name: str) -> list[str]:
        """What the autoscaler recorded about the box (events), oldest first; `name` is
        the released box's key when it is gone."""
        ...

    def close(self) -> None:
        """Stop what the world started (a watch); it is not used after."""
        ...
