"""The local backend: a box is a detached `devbox agent` on 127.0.0.1 with its own home
folder and, where the machine has GPUs, an exclusive set of them."""

from __future__ import annotations

import builtins
import dataclasses
import os
import pwd
import shutil
import signal
import socket
import time
from pathlib import Path

from devbox import names, paths, private, profiles, protocol
from devbox.backends.local.launcher import start_agent
from devbox.backends.local.store import BoxStore
from devbox.boxes import Box, BoxSpec, BoxState, Multiplexer
from devbox.config import Config
from devbox.errors import StateError, UsageError
from devbox.profiles import Profile
from devbox.ssh import known_hosts
from devbox.ssh.keys import ensure_user_key

STOP_TIMEOUT = 10.0


def _login() -> str:
    """The account the kernel runs this process as, not $USER or $LOGNAME (which anyone
    may set to anything)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (a container)
        return str(os.getuid())


class LocalBackend:
    name = "local"

    def __init__(self, *, config: Config, root: Path | None = None) -> None:
        self.config = config
        if root is None:
            # The state folder holds known_hosts and the autoscaler's state too: close it
            # all, and what an older devbox left readable in it.
            root = private.ensure_dir(paths.state_dir()) / "local"
            private.tighten_folder(root.parent)
            private.tighten_folder(root.parent / "sync")
        self.store = BoxStore(root)
        self.store.secure()
        self._problems: list[str] = []

    # --- profiles -------------------------------------------------------------------

    def profiles(self) -> builtins.list[Profile]:
        return builtins.list(profiles.resolve(self.config.profiles).values())

    def resolve(self, profile: str, *, gpus: int | None = None) -> BoxSpec:
        """Only a profile's GPU count applies on this machine: its agent is a process
        here, with no requests, node or image to choose."""
        chosen = profiles.choose(profiles.resolve(self.config.profiles), profile)
        return BoxSpec(gpus=chosen.gpus if gpus is None else gpus, profile=chosen.name)

    # --- claim ----------------------------------------------------------------------

    def _reserve(self, spec: BoxSpec, name: str | None) -> Box:
        with self.store.locked():
            if name is None:
                name = names.generate_name()
                while self.store.exists(name):
                    name = names.generate_name()
            elif self.store.exists(name):
                raise UsageError(f"a box named {name!r} already exists (see `devbox ls`)")
            box = Box(
                name=name,
                owner=_login(),
                backend=self.name,
                spec=spec,
                state=BoxState.PENDING,
                host="127.0.0.1",
                created_at=time.time(),
            )
            self.store.write(box)  # the name is taken from here on
            return box

    def claim(self, spec: BoxSpec, *, name: str | None = None, port: int = 0) -> Box:
        if name is not None:
            names.validate_name(name)
        owner_key = ensure_user_key()
        box = self._reserve(spec, name)
        folder = self.store.box_dir(box.name)
        private.write_text(folder / "authorized_key", owner_key + "\n")
        # A box gets a new host key each time it is claimed; the old pin goes with it.
        (folder / "host_key").unlink(missing_ok=True)
        try:
            ready = start_agent(
                name=box.name,
                folder=folder,
                gpus=spec.gpus,
                port=port,
                multiplexer=self.config.multiplexer,
                timeout=self.config.start_timeout,
            )
        except BaseException:
            self.store.remove(box.name)
            raise
        box = dataclasses.replace(
            box,
            state=BoxState.RUNNING,
            port=ready.port,
            host_key=ready.host_key,
            host_key_fingerprint=ready.fingerprint,
            gpu_ids=ready.gpu_ids,
            extra={
                "pid": str(ready.pid),
                "multiplexer": ready.multiplexer,
                "home": str(folder / "home"),
            },
        )
        self.store.write(box)
        known_hosts.pin(box.name, box.host_key)
        return box

    # --- inspect --------------------------------------------------------------------

    def _with_live_state(self, box: Box) -> Box:
        box = self._with_alerts(box)
        alive = self.store.agent_alive(box.name)
        last_input, _clients = self.store.activity(box.name)
        if alive:
            # A pending record with a live agent is a claim between the agent's start and
            # its READY: no port or host key yet, so not reachable until the record says so.
            state = BoxState.PENDING if box.state is BoxState.PENDING else BoxState.RUNNING
            return dataclasses.replace(box, state=state, last_activity=last_input or box.created_at)
        if (
            box.state is BoxState.PENDING
            and time.time() - box.created_at < self.config.start_timeout
        ):
            return box
        # The kernel dropped the agent's GPU names (devbox.gpulocks) when it died, and no
        # other process can have inherited them: say so, keep the record.
        return dataclasses.replace(
            box,
            state=BoxState.FAILED,
            last_activity=last_input,
            reason="agent is not running (GPUs freed); `devbox down` it",
        )

    def _with_alerts(self, box: Box) -> Box:
        """The probe's model alerts, as one short cell (extra["alerts"]) for `devbox ls`."""
        alerts = self.store.alerts(box.name)
        if not alerts:
            return box
        cell = protocol.alerts_cell(alerts)  # type: ignore[arg-type]
        return dataclasses.replace(box, extra={**box.extra, "alerts": cell})

    def keep(self, name: str, *, until: float) -> Box:
        self.get(name)  # a clear error for a bad or unknown name
        with self.store.locked():
            box = dataclasses.replace(self.store.read(name), keep_until=until)
            self.store.write(box)
        return self._with_live_state(box)

    def get(self, name: str) -> Box:
        names.validate_name(name)
        try:
            return self._with_live_state(self.store.read(name))
        except FileNotFoundError:
            raise UsageError(f"no box named {name!r} (see `devbox ls`)") from None

    def list(self) -> builtins.list[Box]:
        boxes, self._problems = [], []
        for name in self.store.names():
            try:
                boxes.append(self._with_live_state(self.store.read(name)))
            except StateError as exc:
                self._problems.append(exc.message)
            except FileNotFoundError:
                continue  # went down while we listed
        return boxes

    def problems(self) -> builtins.list[str]:
        return list(self._problems)

    def open_socket(self, box: Box) -> socket.socket:
        sock = socket.create_connection((box.host, box.port), timeout=10)
        # SSH's handshake is small writes in a row: without NODELAY each second one waits
        # for the agent's delayed ACK (40 ms), several times per connection.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    # --- release --------------------------------------------------------------------

    def release(self, name: str, *, purge: bool = False) -> None:
        names.validate_name(name)
        folder = self.store.box_dir(name)
        try:
            box: Box | None = self.store.read(name)
        except FileNotFoundError:
            raise UsageError(f"no box named {name!r} (see `devbox ls`)") from None
        except StateError:
            box = None  # a corrupted record must not make a box impossible to stop
        self._stop_agent(name)
        _remove_probe_socket(folder / "home")
        mux_kind = box.extra.get("multiplexer", "") if box else ""
        for kind in [mux_kind] if mux_kind else ["screen", "tmux"]:
            path = shutil.which(kind)
            if path:  # the agent ends them itself; this covers an agent that died
                Multiplexer(kind, path).end(name, timeout=2.0)
        self.store.remove(name)
        known_hosts.unpin(name)
        if purge:
            shutil.rmtree(folder, ignore_errors=True)

    def _stop_agent(self, name: str) -> None:
        if not self.store.agent_alive(name):
            return
        pid = self.store.agent_pid(name)
        if pid is None:
            raise StateError(f"box {name}: its agent runs but its pid file is unreadable")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while self.store.agent_alive(name):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + STOP_TIMEOUT
            time.sleep(0.02)


def _remove_probe_socket(home: Path) -> None:
    """The probe socket's private folder, which an agent that was killed leaves behind."""
    try:
        path = Path((home / protocol.PROBE_POINTER_FILE).read_text().strip())
    except OSError:
        return
    if path.parent.name.startswith("devbox-probe-"):
        shutil.rmtree(path.parent, ignore_errors=True)
