"""The Backend protocol: what every place boxes can live must offer."""

from __future__ import annotations

import builtins
import socket
from collections.abc import Callable
from typing import Protocol

from devbox.boxes import Box, BoxSpec
from devbox.profiles import Profile


class Backend(Protocol):
    name: str
    # How often a watcher of one box (`devbox proxy`'s release warnings) may look at it:
    # what a look costs here (a file read, or a request to a shared API server).
    look_interval: float

    def profiles(self) -> builtins.list[Profile]:
        """Every profile a claim may name, each with where it came from."""
        ...

    def resolve(self, profile: str, *, gpus: int | None = None) -> BoxSpec:
        """The spec of a box of `profile` (UsageError naming the known ones when there is
        no such profile); `gpus`, an explicit --gpus, replaces the profile's count."""
        ...

    def claim(self, spec: BoxSpec, *, name: str | None = None, port: int = 0) -> Box:
        """Start (or take) a box of `spec` (from `resolve`) and return it running.
        `name` None: generate one."""
        ...

    def release(
        self, name: str, *, purge: bool = False, confirm: Callable[[str], None] | None = None
    ) -> bool:
        """End the box and every process in it, then free its GPUs; its home stays unless
        `purge`. Deleting a home first calls `confirm` with what would go (it raises to
        refuse). True when a box was released; False when only a released box's kept home
        was purged (a backend that keeps such homes per box)."""
        ...

    def keep(self, name: str, *, until: float) -> Box:
        """Hold the box against idle release until `until` (unix time; 0 ends the hold)."""
        ...

    def list(self) -> builtins.list[Box]:
        """Every box of this user, with its current state."""
        ...

    def get(self, name: str) -> Box:
        """The box called `name`; UsageError when there is none."""
        ...

    def open_socket(self, box: Box) -> socket.socket:
        """A connected byte stream to the box's SSH endpoint."""
        ...

    def sync_root(self, box: Box) -> str | None:
        """The absolute folder in the box that `devbox run`/`sync` copy a tree into, where
        the session's $HOME is not the box's own (a local box's sessions have the user's
        real $HOME: ~/FOLDER there would be the user's own files); None: ~/FOLDER."""
        ...

    def problems(self) -> builtins.list[str]:
        """State this backend could not read (one line each); listed boxes are unaffected."""
        ...
