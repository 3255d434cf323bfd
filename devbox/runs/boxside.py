"""The in-box helper the laptop runs over SSH: `python -m devbox.runs.boxside ACTION ...`.

    start SPEC [--follow]     record a run, open its window, (follow its log to the end)
    start - [--follow]        the same, the SPEC read from stdin after a READY line: the
                              laptop starts this while its sync runs, and sends the SPEC
                              once the tree is in the box (a closed stdin starts nothing)
    list                      every run of the box, as one JSON array
    log ID [--follow] [--tail BYTES]
    kill ID                   SIGTERM to the command's process group, SIGKILL after a grace
    attach ID                 become the multiplexer client showing the run's window

An exec of a small helper rather than an agent subsystem: it is the same one round trip,
works through any SSH path (OpenSSH, devbox's client, a ProxyCommand), and keeps the
agent unchanged but for three environment variables it gives sessions. Errors are one
line on stderr, status 2 for bad input and 1 for failures, as on the laptop.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from devbox import private, protocol
from devbox.boxes import LOGIN_WINDOW, TMUX_SESSION, session_name
from devbox.runs import record

KILL_GRACE_SECONDS = 10.0
START_TIMEOUT_SECONDS = 15.0
# A followed log is polled (the standard library has no inotify): every 10 ms for the first
# seconds, when the user waits for the first line, and after any output; at most every
# 100 ms once the run has been quiet for a while.
QUICK_POLL, SLOW_POLL, QUICK_SECONDS = 0.01, 0.1, 3.0


class Failure(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _bad(message: str) -> NoReturn:
    raise Failure(message, 2)


def _box() -> str:
    return os.environ.get(protocol.BOX_ENV, "")


def _find(root: Path, run_id: str) -> record.Run:
    if not record.valid_id(run_id):
        _bad(f"{run_id!r} is not a run id (see `devbox runs {_box()}`)")
    try:
        return record.read(root, run_id)
    except FileNotFoundError:
        _bad(f"no run {run_id!r} in box {_box()} (see `devbox runs {_box()}`)")
    except ValueError as exc:
        raise Failure(str(exc)) from None


# --- start --------------------------------------------------------------------------------


def encode_spec(spec: dict[str, object]) -> str:
    """The laptop's half: a spec as one shell-safe word."""
    return base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()


def _decode_spec(text: str) -> dict[str, object]:
    try:
        spec = json.loads(base64.urlsafe_b64decode(text.encode()))
    except ValueError:
        _bad("malformed run spec")
    if not isinstance(spec, dict):
        _bad("malformed run spec")
    return spec


@contextlib.contextmanager
def _launch_lock(root: Path) -> Iterator[None]:
    # Two runs started at once on a box without a session must not make two sessions.
    fd = os.open(root / ".launch.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _quiet(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10, check=False
    )


def _open_window(kind: str, run: record.Run, folder: Path) -> None:
    wrapper = [sys.executable, "-m", "devbox.runs.wrapper", str(folder)]
    session = session_name(run.box)
    path = shutil.which(kind) if kind in ("screen", "tmux") else None
    if path is None:
        # No multiplexer: a detached process of its own, output to the log only.
        subprocess.Popen(
            wrapper,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return
    # The run gets a window beside the session's login window, never the session's only
    # window: `devbox ssh` must land on a shell, where ctrl-c ends nothing of the run's.
    if kind == "screen":
        # Window numbers from 1: screen's 0 is the login window that attaching selects.
        open_run = [path, "-S", session, "-X", "screen", "-t", run.window, "1", *wrapper]
        make_session = [path, "-dmS", session, "-t", LOGIN_WINDOW]
    else:
        open_run = [path, "-L", session, "new-window", "-d", "-t", f"={TMUX_SESSION}:",
                    "-n", run.window, shlex.join(wrapper)]  # fmt: skip
        make_session = [path, "-L", session, "new-session", "-d", "-s", TMUX_SESSION,
                        "-n", LOGIN_WINDOW]  # fmt: skip
    result = _quiet(open_run)
    if result.returncode != 0:
        # No session yet (the usual case once, on a box made with --no-attach): make one
        # with its login shell in the home, as attaching would, then add the run to it.
        _quiet_in_home(make_session)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while (result := _quiet(open_run)).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # screen -dm may return before its session answers
    if result.returncode != 0:
        raise Failure(f"{kind} could not open the run's window: {result.stdout or result.stderr}")
    if kind == "screen":
        # screen shows a new window at once, even to a user typing in their shell there
        # (whose next ctrl-c would end the run): back to what they had (tmux: -d above).
        _quiet([path, "-S", session, "-X", "other"])


def _quiet_in_home(argv: list[str]) -> None:
    home = os.environ.get("HOME")
    subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=10,
        check=False,
        cwd=home if home and os.path.isdir(home) else None,
    )


# `start -`: the helper is up (Python started, imported) and waits for its spec. An older
# helper refuses "-" as a malformed spec before it says this, which is how the laptop tells.
GATED = "-"
READY = "devbox-run-ready"


def _gated_spec() -> str | None:
    print(READY, flush=True)
    line = sys.stdin.readline().strip()
    return line or None


def start(root: Path, spec_text: str, *, follow: bool) -> int:
    if spec_text == GATED:
        got = _gated_spec()
        if got is None:
            return 0  # the laptop's sync failed or was interrupted: nothing was started
        spec_text = got
    spec = _decode_spec(spec_text)
    run_id = str(spec.get("id", ""))
    if not record.valid_id(run_id):
        _bad(f"{run_id!r} is not a run id")
    command = str(spec.get("command", "")).strip()
    if not command:
        _bad("no command to run")
    cwd = Path(str(spec.get("cwd") or "."))
    cwd = (Path.cwd() / cwd).resolve()
    if not cwd.is_dir():
        _bad(f"no folder {cwd} in box {_box()}")
    kind = os.environ.get(record.MULTIPLEXER_ENV, "none")
    # 0700: a run's command line, record and log are nobody else's (and in a box on a
    # shared workstation, tightened from an older 0755 tree).
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    record.active_dir(root).mkdir(mode=0o700, exist_ok=True)
    private.tighten([root, record.active_dir(root)])
    folder = record.run_dir(root, run_id)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        raise Failure(f"box {_box()} already has a run {run_id}; try again") from None
    commit = spec.get("git_commit")
    dirty = spec.get("git_dirty")
    run = record.Run(
        id=run_id,
        box=_box(),
        command=command,
        cwd=str(cwd),
        created_at=time.time(),
        source=str(spec.get("source") or ""),
        git_commit=str(commit) if commit else None,
        git_dirty=bool(dirty) if dirty is not None else None,
        gpus=os.environ.get("CUDA_VISIBLE_DEVICES"),
        multiplexer=kind if kind in ("screen", "tmux") and shutil.which(kind) else "",
        window=f"run-{run_id}",
    )
    record.write(root, run)
    (record.active_dir(root) / run_id).touch(mode=0o600)
    (folder / "log").touch(mode=0o600)  # the run's output: nobody else's to read
    with _launch_lock(root):
        _open_window(run.multiplexer or "none", run, folder)
    if not follow:
        _wait_started(root, run_id)
        print(json.dumps({"id": run_id, "box": run.box, "window": run.window}))
        return 0
    return follow_log(root, run_id, to_end=True, status=True)


def _wait_started(root: Path, run_id: str) -> record.Run:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while True:
        run = record.read(root, run_id)
        if run.started_at is not None or run.finished:
            return run
        if time.monotonic() > deadline:
            raise Failure(f"run {run_id} did not start within {START_TIMEOUT_SECONDS:g}s")
        time.sleep(0.01)


# --- log ----------------------------------------------------------------------------------


def follow_log(
    root: Path, run_id: str, *, to_end: bool, tail: int | None = None, status: bool = False
) -> int:
    """Copy the log to stdout; with `to_end`, keep following until the run has ended, then
    say how it ended on stderr (and with `status`, exit as the command did)."""
    path = record.log_path(root, run_id)
    out = sys.stdout.buffer
    with open(path, "rb") as log:
        if tail is not None:
            log.seek(max(0, os.fstat(log.fileno()).st_size - tail))
        began = time.monotonic()
        idle = QUICK_POLL
        while True:
            chunk = log.read(256 * 1024)
            if chunk:
                out.write(chunk)
                out.flush()
                idle = QUICK_POLL
                continue
            if not to_end:
                return 0
            run = record.read(root, run_id)
            if run.finished:
                rest = log.read()
                if rest:
                    out.write(rest)
                    out.flush()
                _say_end(run)
                return run.status_code() if status else 0
            if run.state == record.STARTING and time.time() - run.created_at > (
                START_TIMEOUT_SECONDS
            ):
                raise Failure(f"run {run_id} did not start within {START_TIMEOUT_SECONDS:g}s")
            # Quick at first (the first line is what the user waits for), then gentle.
            time.sleep(idle)
            if time.monotonic() - began > QUICK_SECONDS:
                idle = min(idle * 2, SLOW_POLL)


def _say_end(run: record.Run) -> None:
    took = run.duration(time.time())
    after = f" after {took:.1f}s" if took is not None else ""
    how = {record.LOST: "was lost (its wrapper ended without a status)"}.get(
        run.state, f"ended: {run.outcome()}"
    )
    if run.state == record.KILLED:
        how = f"was killed ({run.outcome()})"
    print(f"devbox: run {run.id} on box {run.box} {how}{after}", file=sys.stderr, flush=True)


# --- kill, attach ---------------------------------------------------------------------------


def kill(root: Path, run_id: str) -> int:
    run = _find(root, run_id)
    if run.finished:
        _bad(f"run {run_id} is not running (it {run.state}: {run.outcome()})")
    if run.pid is None:
        run = _wait_started(root, run_id)
    (record.run_dir(root, run_id) / "killed").touch()
    if run.pid is None:
        return 0  # it ended on its own meanwhile
    deadline = time.monotonic() + KILL_GRACE_SECONDS
    signum = signal.SIGTERM
    while record.read(root, run_id).state == record.RUNNING:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.pid, signum)
        if time.monotonic() > deadline:
            signum = signal.SIGKILL
        time.sleep(0.05)
    ended = record.read(root, run_id)
    print(f"devbox: run {run_id} on box {run.box} killed ({ended.outcome()})", file=sys.stderr)
    return 0


def attach(root: Path, run_id: str) -> int:
    run = _find(root, run_id)
    if run.finished:
        _bad(
            f"run {run_id} has ended ({run.outcome()}); "
            f"`devbox logs {run.box} {run_id}` shows its output"
        )
    path = shutil.which(run.multiplexer) if run.multiplexer else None
    if path is None:
        _bad(
            f"run {run_id} has no window (no screen or tmux in the box); "
            f"`devbox logs {run.box} {run_id} -f` follows it"
        )
    session = session_name(run.box)
    if run.multiplexer == "screen":
        argv = [path, "-x", "-S", session, "-p", run.window]
    else:
        argv = [path, "-L", session, "select-window", "-t", f"={TMUX_SESSION}:={run.window}",
                ";", "attach-session", "-t", f"={TMUX_SESSION}"]  # fmt: skip
    sys.stdout.flush()
    os.execv(path, argv)


# --- entry ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="devbox.runs.boxside")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("start")
    s.add_argument("spec")
    s.add_argument("--follow", action="store_true")
    sub.add_parser("list")
    lg = sub.add_parser("log")
    lg.add_argument("id")
    lg.add_argument("--follow", action="store_true")
    lg.add_argument("--tail", type=int)
    for name in ("kill", "attach"):
        sub.add_parser(name).add_argument("id")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = record.default_dir()
    try:
        if args.action == "start":
            return start(root, args.spec, follow=args.follow)
        if args.action == "list":
            print(json.dumps([r.to_json() for r in record.read_all(root)]))
            return 0
        if args.action == "log":
            _find(root, args.id)
            return follow_log(root, args.id, to_end=args.follow, tail=args.tail)
        if args.action == "kill":
            return kill(root, args.id)
        return attach(root, args.id)
    except Failure as exc:
        print(f"devbox: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
