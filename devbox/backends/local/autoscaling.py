"""The autoscaler's view of the local backend: this user's boxes on this machine, their
agents' activity files, and the records where its decisions are kept."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from devbox import paths, private
from devbox.autoscaler import policy
from devbox.autoscaler.loop import Snapshot
from devbox.autoscaler.state import State, loads
from devbox.backends.local import LocalBackend
from devbox.boxes import Box, Multiplexer, release_warning
from devbox.errors import UsageError


def state_file() -> Path:
    return paths.state_dir() / "autoscaler.json"


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
            self._tell(box, release_warning(box.name, action.reason, action.release_at))
            return True
        if isinstance(action, policy.Unwarn):
            box = self._update(action.key, action, release_at=0.0, release_reason="")
            if box is not None:
                self._tell(box, f"devbox: box {box.name} will not be released: {action.why}")
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
            return self.backend.release(action.key, unless_kept=True)  # the home stays
        return False  # no warm pool on this machine

    def _tell(self, box: Box, text: str) -> None:
        kind = box.extra.get("multiplexer", "")
        path = shutil.which(kind) if kind in ("screen", "tmux") else None
        if path is None:
            return
        Multiplexer(kind, path).tell(box.name, text)

    def settings_text(self) -> tuple[str, str] | None:
        from devbox.autoscaler.service import local_settings_file

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

    def load_state(self) -> State:
        try:
            return loads(state_file().read_text())
        except FileNotFoundError:
            return State()

    def save_state(self, text: str) -> None:
        path = state_file()
        private.ensure_dir(path.parent)
        private.write_text(path, text)
