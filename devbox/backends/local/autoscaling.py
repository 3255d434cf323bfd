"""The autoscaler's view of the local backend: this user's boxes on this machine, their
agents' activity files, and the records where its decisions are kept."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

from devbox import config as config_mod
from devbox import names, paths, private, protocol, saves, terminals
from devbox.autoscaler import policy
from devbox.autoscaler.state import State, loads
from devbox.autoscaler.world import Snapshot
from devbox.backends.local import LocalBackend
from devbox.boxes import Box, Multiplexer, release_warning, release_withdrawn
from devbox.errors import UsageError

log = logging.getLogger("devbox.autoscaler")


def state_file() -> Path:
    return paths.state_dir() / "autoscaler.json"


def box_here() -> tuple[LocalBackend, str]:
    """The local box this process runs in, for a bare `devbox keep` in the box's terminal:
    $DEVBOX_BOX names it (the agent sets it in sessions), and descent from that box's
    keeper proves it (every process of a local box descends from it); UsageError elsewhere."""
    name = os.environ.get(protocol.BOX_ENV, "")
    if not name:
        raise UsageError("name the box to keep: `devbox keep NAME` (in a box, NAME is optional)")
    names.validate_name(name)
    backend = LocalBackend(config=config_mod.load())
    keeper = backend.store.keeper_pid(name)
    alive = keeper is not None and backend.store.keeper_alive(name)
    if not alive or os.getpid() not in terminals.Processes().below([keeper or 0]):
        # A pod: its agent's token may not write the keep annotation (images/k8s/policies.yaml).
        raise UsageError(
            f"a bare `devbox keep` keeps the local box it runs in, and this is not in one: "
            f"`devbox keep {name}` where you claimed box {name} keeps it"
        )
    return backend, name


class LocalWorld:
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self.store = backend.store

    def facts(self, box: Box) -> policy.BoxFacts:
        activity, written = self.store.activity_report(box.name)
        return policy.BoxFacts(key=box.name, box=box, activity=activity, heartbeat_at=written)

    def snapshot(self) -> Snapshot:
        # Files on this machine: reading them is the list-watch of the local backend.
        return Snapshot([self.facts(box) for box in self.backend.list()])

    def _update(self, name: str, check: policy.Action, **changes: object) -> Box | None:
        """Rewrite the box's record under the store lock; None when the box changed so
        that the action no longer applies (gone, or kept meanwhile)."""
        with self.store.locked():
            try:
                box = self.store.read(name)
            except FileNotFoundError:
                return None
            if isinstance(check, policy.Warn) and box.keep_until > time.time():
                return None
            box = dataclasses.replace(box, **changes)  # type: ignore[arg-type]
            self.store.write(box)
            return box

    def apply(self, action: policy.Action) -> bool:
        if isinstance(action, policy.Warn):
            box = self._update(
                action.key, action, release_at=action.release_at, release_reason=action.reason
            )
            if box is None:
                return False
            text = release_warning(box.name, action.reason, action.release_at, keep_inside=True)
            self._tell(box, text)
            return True
        if isinstance(action, policy.Unwarn):
            box = self._update(action.key, action, release_at=0.0, release_reason="")
            if box is not None:
                self._tell(box, release_withdrawn(box.name, action.why))
            return box is not None
        if isinstance(action, policy.MarkUnhealthy):
            return self._update(action.key, action, unhealthy_since=action.since) is not None
        if isinstance(action, policy.MarkHealthy):
            return self._update(action.key, action, unhealthy_since=0.0) is not None
        if isinstance(action, policy.Release):
            try:
                current = self.backend.get(action.key)
            except UsageError:
                return False  # already gone: never released twice
            if current.keep_until > time.time():
                return False
            # Checked again under the name's lock: a `keep` since the look above holds it.
            # The box's probed processes save first (devbox.saves); the home stays.
            save = saves.Ask(within=action.save_within, reason=action.reason)
            released = self.backend.release(action.key, unless_kept=True, save=save)
            for result in save.results:
                log.info("box %s: %s", action.key, saves.line(result))
            return released
        return False  # no warm pool on this machine

    def _tell(self, box: Box, text: str) -> None:
        """In the box's session, through its multiplexer, and in every other terminal of
        the box (an editor's, an `ssh -t`'s), which a session message never reaches."""
        kind = box.multiplexer
        path = shutil.which(kind) if kind in terminals.MULTIPLEXERS else None
        if path is not None:
            Multiplexer(kind, path).tell(box.name, text)
        keeper = self.store.keeper_pid(box.name)
        # Only while the keeper lives: a dead keeper's pid may be anyone's process now.
        if keeper is None or not self.store.keeper_alive(box.name):
            return
        table = terminals.Processes()
        told = terminals.tell(
            text,
            table=table,
            box=table.below([keeper]),  # every process of a local box descends from it
            multiplexers=terminals.multiplexer_programs(*([path] if path else [])),
        )
        log.info("box %s: told %d terminal(s) outside its session", box.name, told)

    def settings_text(self) -> tuple[str, str] | None:
        from devbox.paths import local_settings_file

        path = local_settings_file()
        try:
            return path.read_text(), str(path)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read autoscaler config {path}: {exc}") from None

    def find(self, name: str) -> policy.BoxFacts | None:
        try:
            return self.facts(self.backend.get(name))
        except UsageError:
            return None

    def history(self, facts: policy.BoxFacts | None, name: str) -> list[str]:
        return []  # the autoscaler's log and state file hold it locally

    def close(self) -> None:
        pass  # it reads files as it goes: nothing runs in the background

    def load_state(self) -> State:
        try:
            return loads(state_file().read_text())
        except FileNotFoundError:
            return State()

    def save_state(self, text: str) -> None:
        path = state_file()
        private.ensure_dir(path.parent)
        private.write_text(path, text)
