"""A run's record in the box, and the folder that holds every run of the box.

    RUNS/<id>/run.json   the record (written by the helper, then by the wrapper at start and end)
    RUNS/<id>/log        everything the command wrote to its terminal
    RUNS/<id>/lock       flock-held by the wrapper while the run lives: the kernel drops it
                         however the wrapper ends, so "running" never outlives the process
    RUNS/<id>/killed     `devbox kill` asked for the end
    RUNS/active/<id>     one marker per run not yet ended: what the agent counts, cheaply

RUNS is $DEVBOX_RUNS_DIR, which the agent sets to `.devbox/runs` in the box's home. Standard
library only: the agent and the in-box helper import this.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from devbox import private
from devbox.locks import lock_held  # the wrapper's lock is probed as the agent's is

# What the agent gives every session for `devbox run` (agent/server.py): the runs' folder
# (RUNS_FOLDER under the box's home), the interpreter that has devbox whatever PATH says,
# and the multiplexer of the box's sessions.
RUNS_ENV = "DEVBOX_RUNS_DIR"
RUNS_FOLDER = ".devbox/runs"
PYTHON_ENV = "DEVBOX_PYTHON"
MULTIPLEXER_ENV = "DEVBOX_MULTIPLEXER"
# Short enough to type; no look-alike characters (0/o, 1/l/i).
_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"
ID_LENGTH = 4
_ID = re.compile(r"^[a-z0-9]{1,32}$")
# A run whose wrapper has not reported within this long never started.
START_GRACE_SECONDS = 30.0

STARTING, RUNNING, DONE, FAILED, KILLED, LOST = (
    "starting",
    "running",
    "done",
    "failed",
    "killed",
    "lost",
)


def new_id() -> str:
    import secrets  # only the laptop makes ids: the box-side start-up skips it

    return "".join(secrets.choice(_ALPHABET) for _ in range(ID_LENGTH))


def valid_id(run_id: str) -> bool:
    return bool(_ID.match(run_id))


def default_dir() -> Path:
    return Path(os.environ.get(RUNS_ENV) or Path.home() / RUNS_FOLDER)


@dataclass(frozen=True, kw_only=True)
class Run:
    id: str
    box: str
    command: str  # as `ssh host CMD`: the words joined, the login shell parses them
    cwd: str  # in the box
    created_at: float
    source: str = ""  # the laptop folder synced into `cwd`, if any
    git_commit: str | None = None  # of the synced tree; None: not a git checkout
    git_dirty: bool | None = None  # uncommitted changes (untracked files count) when synced
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES the command saw; None: unset
    multiplexer: str = ""  # "screen", "tmux", or "" (detached, no window)
    window: str = ""  # the window's name in the box's session
    started_at: float | None = None
    pid: int | None = None  # the command's; it leads its own process group
    ended_at: float | None = None
    exit_code: int | None = None
    signal: str | None = None  # "TERM" when a signal ended it
    # Derived when read, never stored: see `state_of`.
    state: str = STARTING
    killed: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})

    @property
    def finished(self) -> bool:
        return self.state in (DONE, FAILED, KILLED, LOST)

    def outcome(self) -> str:
        """How it ended, for people: `exit 0`, `exit 3`, `SIGTERM`, or `-` while it runs."""
        if self.signal:
            return f"SIG{self.signal}"
        if self.exit_code is not None:
            return f"exit {self.exit_code}"
        return "-"

    def duration(self, now: float) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or now) - self.started_at

    def status_code(self) -> int:
        """What `devbox run` exits with after following the run to its end, as a shell does."""
        if self.signal:
            try:
                return 128 + int(signal.Signals[f"SIG{self.signal}"])
            except KeyError:
                return 128
        return self.exit_code if self.exit_code is not None else 1


def state_of(run: Run, *, alive: bool, killed: bool, now: float) -> str:
    """Pure: the state of a stored record, given whether its wrapper still holds the lock."""
    if run.ended_at is not None:
        if killed:
            return KILLED
        return DONE if run.exit_code == 0 and not run.signal else FAILED
    if alive:
        return RUNNING
    if run.started_at is None and now - run.created_at < START_GRACE_SECONDS:
        return STARTING
    return LOST  # the wrapper ended without writing an end: killed -9, or the box went down


# --- the runs folder -------------------------------------------------------------------


def run_dir(root: Path, run_id: str) -> Path:
    return root / run_id


def log_path(root: Path, run_id: str) -> Path:
    return root / run_id / "log"


def lock_path(root: Path, run_id: str) -> Path:
    return root / run_id / "lock"


def active_dir(root: Path) -> Path:
    return root / "active"


def write(root: Path, run: Run) -> None:
    """Atomically: a reader never sees half a record."""
    data = run.to_json()
    data.pop("state")
    data.pop("killed")
    path = root / run.id / "run.json"
    private.write_text(path, json.dumps(data))  # 0600: other users of a workstation


def read(root: Path, run_id: str, *, now: float | None = None) -> Run:
    """The stored record with its state; FileNotFoundError when there is no such run,
    ValueError when the record is unreadable."""
    folder = root / run_id
    try:
        data = json.loads((folder / "run.json").read_text())
        run = Run.from_json(data)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"run {run_id}: unreadable record ({exc})") from None
    killed = (folder / "killed").exists()
    state = state_of(run, alive=lock_held(folder / "lock"), killed=killed, now=now or time.time())
    return replace(run, state=state, killed=killed)


def read_all(root: Path) -> list[Run]:
    runs = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    now = time.time()
    for name in names:
        if name == "active" or not valid_id(name):
            continue
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, ValueError):
            runs.append(read(root, name, now=now))
    runs.sort(key=lambda r: (r.created_at, r.id))
    return runs


def count_running(root: Path) -> int:
    """Runs whose wrapper is alive: one listdir of the markers and one flock probe each, so
    the agent can ask every couple of seconds without reading any record."""
    try:
        names = os.listdir(active_dir(root))
    except FileNotFoundError:
        return 0
    return sum(1 for name in names if valid_id(name) and lock_held(root / name / "lock"))
