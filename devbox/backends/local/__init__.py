"""The local backend: a box is a detached `devbox agent` on 127.0.0.1 with its own home
folder and, where the machine has GPUs, an exclusive set of them, under a keeper process
that every process of the box descends from (keeper.py): the box, and its hold on the
GPUs, lasts until the last of them ends, and `down` ends them all."""

from __future__ import annotations

import builtins
import dataclasses
import os
import pwd
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from devbox import names, paths, private, profiles, protocol, saves
from devbox.backends.local import keeper
from devbox.backends.local.store import AUTHORIZED_KEY, HOME, HOST_KEY, RELEASE_FILE, BoxStore
from devbox.boxes import Box, BoxSpec, BoxState, Multiplexer
from devbox.config import Config
from devbox.errors import DevboxError, ResourceError, StateError, UsageError
from devbox.profiles import Profile
from devbox.ssh import known_hosts
from devbox.ssh.keys import ensure_user_key

if TYPE_CHECKING:
    import socket

    from devbox.autoscaler.world import Inspectable
    from devbox.backends.base import WarmPool
    from devbox.backends.local.launcher import Ready

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
    look_interval = 2.0  # a record file on this machine
    direct_ssh = True  # the agent listens on 127.0.0.1:box.port

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

    def _reserve(self, spec: BoxSpec, name: str) -> bool:
        """Write the pending record (the name is taken from here on); whether the box
        folder is new, so that a failed claim removes it whole (else a kept home is in it)."""
        with self.store.locked():
            if self.store.exists(name):
                raise UsageError(f"a box named {name!r} already exists (see `devbox ls`)")
            new = not self.store.box_dir(name).exists()
            box = Box(
                name=name,
                owner=_login(),
                backend=self.name,
                spec=spec,
                state=BoxState.PENDING,
                host="127.0.0.1",
                created_at=time.time(),
            )
            self.store.write(box)
            return new

    def _unused_name(self) -> str:
        name = names.generate_name()
        # Nor the name of a released box whose home is kept: a new box starts empty.
        while self.store.box_dir(name).exists():
            name = names.generate_name()
        return name

    def claim(self, spec: BoxSpec, *, name: str | None = None) -> Box:
        if name is not None:
            names.validate_name(name)
        owner_key = ensure_user_key()
        chosen = name or self._unused_name()
        with self.store.name_locked(chosen):
            return self._claim(spec, chosen, owner_key=owner_key, port=self.config.port)

    def _claim(self, spec: BoxSpec, name: str, *, owner_key: str, port: int) -> Box:
        new_folder = self._reserve(spec, name)
        folder = self.store.box_dir(name)
        try:
            private.write_text(folder / AUTHORIZED_KEY, owner_key + "\n")
            # A box gets a new host key each time it is claimed; the old pin goes with it.
            (folder / HOST_KEY).unlink(missing_ok=True)
            # Only a claim starts an agent: the launcher (subprocess, the GPU locks) stays
            # out of `ssh`, `ls` and `proxy`, which only read the store.
            from devbox.backends.local.launcher import start_agent

            ready = start_agent(
                name=name,
                folder=folder,
                gpus=spec.gpus,
                port=port,
                multiplexer=self.config.multiplexer,
                timeout=self.config.start_timeout,
                hang=self.config.hang,
            )
            box = self._record_up(name, ready, home=folder / HOME)
            known_hosts.pin(box.name, box.host_key)
        except BaseException as exc:
            # Interrupted or failed at any point: first end all that was started, then
            # forget the name. A second interrupt in here leaves the record, which `ls`
            # shows and `down` removes: never a process without a record.
            self._end_processes(name, mux_kind="")
            known_hosts.unpin(name)
            # A new folder holds nothing of the user's: no half-made folder stays, but for
            # the log of an agent that broke, which the error points at.
            broke = isinstance(exc, DevboxError) and not isinstance(exc, UsageError | ResourceError)
            if new_folder and not broke:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                self.store.remove(name)
            raise
        return box

    def _record_up(self, name: str, ready: Ready, *, home: Path) -> Box:
        """The running record, over the record as it is now: what `keep` or the autoscaler
        wrote during the claim stays."""
        with self.store.locked():
            box = dataclasses.replace(
                self.store.read(name),
                state=BoxState.RUNNING,
                port=ready.port,
                host_key=ready.host_key,
                host_key_fingerprint=ready.fingerprint,
                gpu_ids=ready.gpu_ids,
                multiplexer=ready.multiplexer,
                extra={"pid": str(ready.pid), "home": str(home)},
            )
            self.store.write(box)
        return box

    # --- inspect --------------------------------------------------------------------

    def _with_live_state(self, box: Box) -> Box:
        box = self._with_alerts(box)
        alive = self.store.agent_alive(box.name)
        last_input, _clients, hung_since = self.store.activity(box.name)
        if alive:
            # A pending record with a live agent is a claim between the agent's start and
            # its READY: no port or host key yet, so not reachable until the record says so.
            state = BoxState.PENDING if box.state is BoxState.PENDING else BoxState.RUNNING
            return dataclasses.replace(
                box,
                state=state,
                last_activity=last_input or box.created_at,
                hung_since=hung_since,
            )
        if (
            box.state is BoxState.PENDING
            and time.time() - box.created_at < self.config.start_timeout
        ):
            return box
        left = self._processes_left(box.name)
        if left:
            # Its keeper holds the GPU names for them (keeper.py): the GPUs are not free.
            what = "still hold its GPUs" if box.gpu_ids else "of the box still run"
            reason = f"agent is not running; {left} process(es) {what}; `devbox down` ends them"
        else:
            # No process of the box is left, so nothing holds its GPU names (gpulocks).
            reason = "agent is not running (GPUs freed); `devbox down` it"
        return dataclasses.replace(
            box, state=BoxState.FAILED, last_activity=last_input, reason=reason
        )

    def _processes_left(self, name: str) -> int:
        pid = self.store.keeper_pid(name) if self.store.keeper_alive(name) else None
        return 0 if pid is None else len(keeper.descendants(pid))

    def _with_alerts(self, box: Box) -> Box:
        """The probe's model alerts, as one short cell (Box.alerts) for `devbox ls`."""
        alerts = self.store.alerts(box.name)
        if not alerts:
            return box
        cell = protocol.alerts_cell(alerts)
        return dataclasses.replace(box, alerts=cell)

    def keep(self, name: str, *, until: float) -> Box:
        self.get(name)  # a clear error for a bad or unknown name
        # After a claim of the name in progress, before a release: never lost to either.
        with self.store.name_locked(name), self.store.locked():
            try:
                box = dataclasses.replace(self.store.read(name), keep_until=until)
            except FileNotFoundError:
                raise UsageError(f"no box named {name!r} (see `devbox ls`)") from None
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

    def unlisted(self) -> builtins.list[builtins.list[str]]:
        return []  # one place: listed whole, or an error

    def problems(self) -> builtins.list[str]:
        return list(self._problems)

    def open_socket(self, box: Box) -> socket.socket:
        import socket  # not at import: `devbox ssh` through OpenSSH opens no socket itself

        sock = socket.create_connection((box.host, box.port), timeout=10)
        # SSH's handshake is small writes in a row: without NODELAY each second one waits
        # for the agent's delayed ACK (40 ms), several times per connection.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def proxy_stdio(self, box: Box) -> bool:
        return False  # a plain socket: the caller's bridge carries it

    def proxy_args(self, box: Box) -> builtins.list[str]:
        return []  # the name alone: boxes of this machine's user live in one place

    def warm_pool(self) -> WarmPool:
        raise UsageError("the warm pool is a kubernetes feature: add --backend kubernetes")

    def autoscaler_worlds(self) -> builtins.list[tuple[str, Inspectable]]:
        return [("", self.autoscaler_world())]

    def autoscaler_world(self, box: str | None = None) -> Inspectable:
        from devbox.backends.local.autoscaling import LocalWorld

        return LocalWorld(self)

    def sync_root(self, box: Box) -> str | None:
        # Sessions have the user's own $HOME: synced trees go to the box's folder instead.
        return str(self.store.box_dir(box.name) / HOME)

    # --- release --------------------------------------------------------------------

    def release(
        self,
        name: str,
        *,
        purge: bool = False,
        confirm: Callable[[str], None] | None = None,
        save: saves.Ask | None = None,
        unless_kept: bool = False,
    ) -> bool:
        """As the protocol says; `unless_kept` (the autoscaler's): not a box that is kept,
        judged under the name's lock, so a `keep` just before is never lost (False)."""
        names.validate_name(name)
        with self.store.name_locked(name):  # after a claim of the name in progress
            return self._release(
                name, purge=purge, confirm=confirm, save=save, unless_kept=unless_kept
            )

    def _release(
        self,
        name: str,
        *,
        purge: bool,
        confirm: Callable[[str], None] | None,
        save: saves.Ask | None,
        unless_kept: bool,
    ) -> bool:
        folder = self.store.box_dir(name)
        try:
            box: Box | None = self.store.read(name)
        except FileNotFoundError:
            if purge and folder.is_dir() and not folder.is_symlink():
                # A released box: only its kept home is left, and this deletes it.
                _confirm(confirm, f"the kept home of released box {name} ({folder / 'home'})")
                shutil.rmtree(folder, ignore_errors=True)
                return False
            raise UsageError(f"no box named {name!r} (see `devbox ls`)") from None
        except StateError:
            box = None  # a corrupted record must not make a box impossible to stop
        if unless_kept and box is not None and box.keep_until > time.time():
            return False
        if purge:  # asked before anything is stopped: a "no" leaves the box as it was
            _confirm(confirm, f"the home of box {name} ({folder / 'home'})")
        # Read by the agent and its keeper as the keeper's SIGTERM arrives (devbox.saves):
        # the keeper waits for the agent that much longer, as a pod's grace period does.
        within = save.within if save is not None else 0.0
        request = saves.request(within, save.reason if save is not None else "down")
        private.write_text(folder / RELEASE_FILE, request)
        self._end_processes(name, mux_kind=box.multiplexer if box else "", longer=within)
        if save is not None:
            save.results = self.store.saved(name)
        _remove_probe_socket(folder / HOME)
        self.store.remove(name)
        known_hosts.unpin(name)
        if purge:
            shutil.rmtree(folder, ignore_errors=True)
        return True

    def _end_processes(self, name: str, *, mux_kind: str, longer: float = 0.0) -> None:
        """End every process of the box, as deleting a pod does; return once all are gone,
        and with them the box's hold on its GPUs. `longer`: the seconds the release gives
        the box's processes to save, which the keeper adds to the agent's grace."""
        from devbox.backends.local.launcher import END_TIMEOUT  # not at import: see _claim

        if self.store.keeper_alive(name):
            pid = self.store.keeper_pid(name)
            if pid is None:
                raise StateError(f"box {name}: its keeper runs but its pid file is unreadable")
            os.kill(pid, signal.SIGTERM)  # the keeper ends them all, then itself
            if self._wait(lambda: not self.store.keeper_alive(name), END_TIMEOUT + longer):
                return
            keeper.signal_all(pid, signal.SIGKILL)  # a keeper that hangs: do its work
            os.kill(pid, signal.SIGKILL)
            self._wait(lambda: not self.store.keeper_alive(name), STOP_TIMEOUT)
            return
        # A box started before keepers existed, or whose keeper was killed: its agent and
        # the sessions, the processes of the box that can still be found.
        self._stop_agent(name)
        for kind in [mux_kind] if mux_kind else ["screen", "tmux"]:
            path = shutil.which(kind)
            if path:
                Multiplexer(kind, path).end(name, timeout=2.0)

    @staticmethod
    def _wait(done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _stop_agent(self, name: str) -> None:
        if not self.store.agent_alive(name):
            return
        pid = self.store.agent_pid(name)
        if pid is None:
            raise StateError(f"box {name}: its agent runs but its pid file is unreadable")
        os.kill(pid, signal.SIGTERM)
        if not self._wait(lambda: not self.store.agent_alive(name), STOP_TIMEOUT):
            os.kill(pid, signal.SIGKILL)
            self._wait(lambda: not self.store.agent_alive(name), STOP_TIMEOUT)


def _confirm(confirm: Callable[[str], None] | None, what: str) -> None:
    """Destroying a home needs a yes: `confirm` asks (or raises); without one, no purge."""
    if confirm is None:
        raise UsageError(f"deleting {what} needs a confirmation")
    confirm(what)


def _remove_probe_socket(home: Path) -> None:
    """The probe socket's private folder, which an agent that was killed leaves behind."""
    try:
        path = Path((home / protocol.PROBE_POINTER_FILE).read_text().strip())
    except OSError:
        return
    private.remove_own_temp_folder(path.parent, protocol.PROBE_FOLDER_PREFIX)
