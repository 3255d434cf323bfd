"""The Backend protocol: what every place boxes can live must offer.

What only some backends can do is declared here too, as a constant or as a method every
backend has (answering None, or raising a one-line UsageError, where it does not apply):
callers ask the backend, and never probe it with getattr/isinstance or branch on its name
(tests/unit/test_backend_seams.py)."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from devbox import saves
from devbox.boxes import Box, BoxSpec
from devbox.profiles import Profile

if TYPE_CHECKING:
    import socket

    from devbox.autoscaler.world import Inspectable


class WarmPool(Protocol):
    """Unclaimed boxes started ahead of claims, so that a claim takes one in a moment."""

    def warm(self, spec: BoxSpec, *, size: int, wait: bool = True) -> builtins.list[Box]:
        """Top the pool of `spec`'s profile up to `size` boxes of its current shape
        (removing those of an older one); returns the pool of that profile."""
        ...

    def pool(self) -> builtins.list[Box]:
        """Every unclaimed box of the pool."""
        ...


class Backend(Protocol):
    name: str
    # How often a watcher of one box (`devbox proxy`'s release warnings) may look at it:
    # what a look costs here (a file read, or a request to a shared API server).
    look_interval: float
    # True: a box's SSH server is dialled at (box.host, box.port), so OpenSSH reaches it
    # with no help. False: only through `open_socket` (a port-forward this process pumps,
    # or `devbox proxy` as OpenSSH's ProxyCommand).
    direct_ssh: bool

    def profiles(self) -> builtins.list[Profile]:
        """Every profile a claim may name, each with where it came from."""
        ...

    def resolve(self, profile: str, *, gpus: int | None = None) -> BoxSpec:
        """The spec of a box of `profile` (UsageError naming the known ones when there is
        no such profile); `gpus`, an explicit --gpus, replaces the profile's count."""
        ...

    def claim(self, spec: BoxSpec, *, name: str | None = None) -> Box:
        """Start (or take) a box of `spec` (from `resolve`) and return it running.
        `name` None: generate one."""
        ...

    def release(
        self,
        name: str,
        *,
        purge: bool = False,
        confirm: Callable[[str], None] | None = None,
        save: saves.Ask | None = None,
    ) -> bool:
        """End the box and every process in it, then free its GPUs; its home stays unless
        `purge`. Deleting a home first calls `confirm` with what would go (it raises to
        refuse). `save`: the box's probed processes are asked to save first, and given
        `save.within` seconds; what they answered is put in `save.results` (None: the box
        ends at once). True when a box was released; False when only a released box's kept
        home was purged (a backend that keeps such homes per box)."""
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

    def proxy_stdio(self, box: Box) -> bool:
        """`devbox proxy`: pump stdin/stdout to the box's SSH endpoint by the backend's own
        means, until either side ends; False: it has none, and the caller bridges
        `open_socket`."""
        ...

    def proxy_args(self, box: Box) -> builtins.list[str]:
        """The `devbox proxy` options, beyond --backend and the box's name, that address
        `box` whatever later commands default to (an ssh config's ProxyCommand)."""
        ...

    def warm_pool(self) -> WarmPool:
        """The backend's warm pool; UsageError (one line) where it has none."""
        ...

    def autoscaler_world(self, box: str | None = None) -> Inspectable:
        """What `devbox autoscaler` and `devbox explain` observe and act on here: where
        the backend spans several clusters, the one holding box `box` (or the one the
        user named; a one-line UsageError when neither says which)."""
        ...

    def autoscaler_worlds(self) -> builtins.list[tuple[str, Inspectable]]:
        """(cluster, world) for each world an autoscaler looks after from here: one, with
        an empty name, unless the backend spans several clusters."""
        ...

    def sync_root(self, box: Box) -> str | None:
        """The absolute folder in the box that `devbox run`/`sync` copy a tree into, where
        the session's $HOME is not the box's own (a local box's sessions have the user's
        real $HOME: ~/FOLDER there would be the user's own files); None: ~/FOLDER."""
        ...

    def unlisted(self) -> builtins.list[builtins.list[str]]:
        """The places the last `list` could not read (a cluster that did not answer), each
        as the `proxy_args` words that address it: their boxes' ssh-config aliases stay."""
        ...

    def problems(self) -> builtins.list[str]:
        """State this backend could not read (one line each); listed boxes are unaffected."""
        ...
