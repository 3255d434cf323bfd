"""On-disk state of local boxes: one folder per box under the XDG state folder.

boxes/NAME/box.json      the record (written atomically: never half a file)
boxes/NAME/agent.lock    held by the agent for its whole life: free lock = dead agent
boxes/NAME/keeper.lock   held by the box's keeper: free lock = no process of the box is left
locks/NAME.lock          held for a whole claim or release of NAME: one at a time per name
boxes/NAME/activity.json the agent's view of user activity
boxes/NAME/alerts.json   model alerts raised by devbox.probe in the box (NaN, exploding, ...)
boxes/NAME/home/         the box's home folder; kept when the box goes down

Folders are 0700 and files 0600 (devbox.private): other users of the machine read none of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from devbox import private, protocol, saves
from devbox.boxes import Box
from devbox.errors import StateError
from devbox.locks import lock_held
from devbox.protocol import PROBE_POINTER_FILE, Activity, ProbeAlert, last_use

# The files of a box folder. The backend names them all: the agent and the keeper are
# given their paths (launcher.py), so these names live here and nowhere else.
RECORD = "box.json"
AGENT_LOCK = "agent.lock"
KEEPER_LOCK = "keeper.lock"
AGENT_LOG = "agent.log"
ACTIVITY_FILE = "activity.json"  # written by the agent (--activity-file)
ALERTS_FILE = "alerts.json"  # written by the agent's probe hub (--alerts-file)
# Written by the backend just before it ends the box: how long its probed processes may
# take to save (devbox.saves; the agent's --release-file, which the keeper reads too) ...
RELEASE_FILE = "release.json"
# ... and what they saved, written by the agent as it ends (--saved-file).
SAVED_FILE = "saved.json"
AUTHORIZED_KEY = "authorized_key"  # the owner's key, read by the agent (--authorized-key)
HOST_KEY = "host_key"  # the agent's, made by it at its first start (--host-key)
HOME = "home"
# What a box folder holds besides its home; an older devbox left them 0644.
BOX_FILES = (
    RECORD,
    AGENT_LOCK,
    KEEPER_LOCK,
    AGENT_LOG,
    ACTIVITY_FILE,
    ALERTS_FILE,
    RELEASE_FILE,
    SAVED_FILE,
    AUTHORIZED_KEY,
    HOST_KEY,
)


class BoxStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.boxes = root / "boxes"

    def box_dir(self, name: str) -> Path:
        return self.boxes / name

    def secure(self) -> None:
        """Make this tree private, tightening one an older devbox left readable (0755/0644);
        a box's home is closed (0700) but what the user keeps in it is theirs to mode."""
        private.ensure_dir(self.boxes)
        private.tighten([self.root / "claim.lock"])
        private.tighten_folder(self.root / "locks")
        for folder in self._folders():
            private.tighten([folder, folder / HOME, *(folder / f for f in BOX_FILES)])
            # The agent's own folder in the home: the probe pointer and the runs' records.
            private.tighten_folder((folder / HOME / PROBE_POINTER_FILE).parent)

    def _folders(self) -> list[Path]:
        try:
            return [p for p in self.boxes.iterdir() if p.is_dir() and not p.is_symlink()]
        except FileNotFoundError:
            return []

    def make_box_dir(self, name: str) -> Path:
        return private.ensure_dir(self.box_dir(name))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialises check-then-create of names among concurrent `devbox up`s."""
        private.ensure_dir(self.boxes)
        fd = os.open(self.root / "claim.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def name_locked(self, name: str) -> Iterator[None]:
        """Serialises the operations on one name (a claim, a release, a keep), each for its
        whole length: a `down` during an `up` waits for the box to be up, then ends it.
        Outside the box folder, which a purge deletes while another may wait on its lock."""
        folder = private.ensure_dir(self.root / "locks")
        fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        return (self.box_dir(name) / RECORD).exists()

    def read(self, name: str) -> Box:
        path = self.box_dir(name) / RECORD
        try:
            data = json.loads(path.read_text())
            return Box.from_json(data)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StateError(f"cannot read state file {path}: {exc.strerror}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"state file {path} is corrupted ({type(exc).__name__}); "
                "`devbox down` it or fix the file"
            ) from None

    def write(self, box: Box) -> None:
        folder = self.make_box_dir(box.name)
        private.write_text(folder / RECORD, json.dumps(box.to_json(), indent=1))

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.box_dir(name) / RECORD).unlink()

    def names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.boxes.iterdir() if (p / RECORD).exists())
        except FileNotFoundError:
            return []

    def agent_alive(self, name: str) -> bool:
        """True while an agent holds the box's lock; the kernel frees it when the agent dies."""
        return lock_held(self.box_dir(name) / AGENT_LOCK)

    def agent_pid(self, name: str) -> int | None:
        return _pid(self.box_dir(name) / AGENT_LOCK)

    def keeper_alive(self, name: str) -> bool:
        """True while any process of the box lives (its keeper outlives them all)."""
        return lock_held(self.box_dir(name) / KEEPER_LOCK)

    def keeper_pid(self, name: str) -> int | None:
        return _pid(self.box_dir(name) / KEEPER_LOCK)

    def activity_report(self, name: str) -> tuple[Activity | None, float]:
        """The agent's whole activity record and when it was written (its heartbeat: the
        agent rewrites it with every second's telemetry); (None, 0) before the first."""
        path = self.box_dir(name) / ACTIVITY_FILE
        try:
            written = path.stat().st_mtime
            data = json.loads(path.read_text())
            activity: Activity = {
                "last_input": float(data["last_input"]),
                "clients": int(data["clients"]),
                "last_probe": float(data.get("last_probe") or 0.0),
                "runs": int(data.get("runs") or 0),
                "gpu_util": _number(data.get("gpu_util")),
                "cpu": _number(data.get("cpu")),
                "last_forward": float(data.get("last_forward") or 0.0),
                "last_sftp": float(data.get("last_sftp") or 0.0),
                "last_exec": float(data.get("last_exec") or 0.0),
                "stalled_since": float(data.get("stalled_since") or 0.0),
                "hung_since": float(data.get("hung_since") or 0.0),
            }
        except (OSError, ValueError, KeyError, TypeError):
            return None, 0.0
        return activity, written

    def activity(self, name: str) -> tuple[float, int, float]:
        """(when a person last used the box, attached clients, since when it is hung);
        zeros when the agent has not reported yet."""
        activity, _ = self.activity_report(name)
        if activity is None:
            return 0.0, 0, 0.0
        return last_use(activity), activity["clients"], activity.get("hung_since", 0.0)

    def saved(self, name: str) -> list[protocol.SaveResult]:
        """What the box's probed processes saved as it was released (its agent's file);
        [] when nothing was asked, answered or written."""
        try:
            return saves.decode((self.box_dir(name) / SAVED_FILE).read_text())
        except (OSError, UnicodeDecodeError):
            return []

    def alerts(self, name: str) -> list[ProbeAlert]:
        """The probe's alerts in the box, first raised first; [] when none or unreadable."""
        try:
            data = json.loads((self.box_dir(name) / ALERTS_FILE).read_text())
            return protocol.alerts(data["alerts"])
        except (OSError, ValueError, KeyError, TypeError):  # ProtocolError is a ValueError
            return []


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
