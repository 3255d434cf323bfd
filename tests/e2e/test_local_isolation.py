"""Two real Unix users share one workstation: mallory attacks alice's boxes.

Each test makes its own users (useradd, removed after even on failure) and runs the real
`devbox` CLI as each of them with runuser, on simulated GPUs. What must hold: the GPU
locks cannot be turned against anyone (no files to plant, no lock to squat), a GPU is
held only by a live process and a refusal names it, and nobody reads another's state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devbox import protocol
from tests import nvml_sim
from tests.conftest import REPO, new_gpu_namespace
from tests.waiting import wait_until

VENV_BIN = Path(sys.executable).parent


@dataclass
class OsUser:
    """A real Unix user of the test machine, with devbox's environment for them."""

    name: str
    uid: int
    home: Path
    env: dict[str, str]

    @property
    def state(self) -> Path:
        return self.home / ".local/state/devbox"

    def box_dir(self, box: str) -> Path:
        return self.state / "local/boxes" / box

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`argv` as this user, with only their environment (runuser, as a login would)."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        return subprocess.run(
            ["runuser", "-u", self.name, "--", "env", "-i", *env, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.home,
            stdin=subprocess.DEVNULL,
        )

    def devbox(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        result = self.run(str(VENV_BIN / "devbox"), *args)
        if check and result.returncode != 0:
            raise AssertionError(f"{self.name}: devbox {' '.join(args)}: {result.stderr}")
        return result

    def up(self, box: str, *extra: str) -> dict[str, Any]:
        done = self.devbox("up", box, "--no-attach", "--json", *extra, check=True)
        record: dict[str, Any] = json.loads(done.stdout)
        return record

    def python(self, code: str) -> subprocess.Popen[str]:
        """A long-lived Python process of this user's, running `code`."""
        env = [f"{k}={v}" for k, v in self.env.items()]
        return subprocess.Popen(
            ["runuser", "-u", self.name, "--", "env", "-i", *env, sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            cwd=self.home,
        )


# Shared by every pytest worker of the machine (scripts/test runs them in parallel): one
# worker must not close /root again while another's users still run Python from under it.
# In /run: only root makes files there, so nobody can plant the modes to put back.
REACH_MUTEX = Path("/run/dbxt-reach.mutex")  # held while opening or closing
REACH_USERS = Path("/run/dbxt-reach.users")  # shared by each worker whose users need it
REACH_MODES = Path("/run/dbxt-reach.modes.json")  # the modes to put back


@contextlib.contextmanager
def _flock(path: Path, how: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, how)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _open_to_others(paths: list[Path]) -> Iterator[None]:
    """Let other users reach the interpreter and the repository: add o+x (search, not
    list) to each folder on the way that lacks it (/root, a CI clone's mkdtemp folder);
    the last worker to finish puts every mode back."""
    with _flock(REACH_USERS, fcntl.LOCK_SH) as users:
        with _flock(REACH_MUTEX, fcntl.LOCK_EX):
            _add_search(paths)
        try:
            yield
        finally:
            with _flock(REACH_MUTEX, fcntl.LOCK_EX):
                fcntl.flock(users, fcntl.LOCK_UN)
                with contextlib.suppress(BlockingIOError):
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else uses it
                    _put_back()


def _add_search(paths: list[Path]) -> None:
    modes = json.loads(REACH_MODES.read_text()) if REACH_MODES.exists() else {}
    for path in paths:
        for folder in [path, *path.parents]:
            mode = stat.S_IMODE(folder.stat().st_mode)
            if folder.is_dir() and not mode & stat.S_IXOTH:
                modes.setdefault(str(folder), mode)
                os.chmod(folder, mode | stat.S_IXOTH)
    REACH_MODES.write_text(json.dumps(modes))


def _put_back() -> None:
    if REACH_MODES.exists():
        for folder, mode in json.loads(REACH_MODES.read_text()).items():
            with contextlib.suppress(FileNotFoundError):
                os.chmod(folder, mode)
        REACH_MODES.unlink()


@dataclass
class Machine:
    """The shared workstation: its simulated GPUs and the users made on it."""

    root: Path
    tmp: Path  # like /tmp: anyone may make things in it (sticky, 1777)
    nvml_dir: Path
    gpu_file: Path
    namespace: str
    users: list[OsUser]

    def gpus(self, count: int) -> list[str]:
        nvml_sim.write_gpus(self.gpu_file, count)
        os.chmod(self.gpu_file, 0o644)  # every user's NVML reads it
        return [f"GPU-sim-{i:04d}" for i in range(count)]

    def user(self, label: str) -> OsUser:
        name = f"dbxt-{label}-{secrets.token_hex(3)}"
        home = self.root / name
        subprocess.run(
            ["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/bash",
             "--user-group", name],
            check=True, capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(name)
        home.mkdir(mode=0o755)  # a typical home: others may look in; devbox's state may not
        os.chown(home, entry.pw_uid, entry.pw_gid)
        short = Path(tempfile.mkdtemp(prefix="dbx", dir="/tmp"))  # sockets: short paths
        (short / "s").mkdir(mode=0o700)
        for folder in (short, short / "s"):
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        user = OsUser(name, entry.pw_uid, home, self._env(home, short))
        self.users.append(user)
        return user

    def _env(self, home: Path, short: Path) -> dict[str, str]:
        return {
            "HOME": str(home),
            "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
            "SCREENDIR": str(short / "s"),
            "TMUX_TMPDIR": str(short),
            "DEVBOX_GPU_NAMESPACE": self.namespace,
            "DEVBOX_NVML_SIM": str(self.gpu_file),
            "LD_LIBRARY_PATH": str(self.nvml_dir),
            "PYTHONPATH": str(REPO),
            "TERM": "xterm-256color",
        }

    def remove_users(self) -> None:
        for user in self.users:
            _kill_processes_of(user.uid)
            subprocess.run(["userdel", user.name], capture_output=True, check=False)
            shutil.rmtree(user.env["TMUX_TMPDIR"], ignore_errors=True)
            # Its agents were killed, so their probe socket folders outlived them.
            for folder in Path(tempfile.gettempdir()).glob(f"{protocol.PROBE_FOLDER_PREFIX}*"):
                with contextlib.suppress(OSError):
                    if folder.lstat().st_uid == user.uid and folder.is_dir():
                        shutil.rmtree(folder)


def _kill_processes_of(uid: int) -> None:
    """Every process of a user this test made (agents, screen, holders), by pid."""
    for _ in range(50):
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == uid]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # for the kernel to reap them


def _uid(proc: Path) -> int | None:
    try:
        return proc.stat().st_uid
    except OSError:
        return None


@pytest.fixture
def machine(nvml_lib_dir: Path) -> Iterator[Machine]:
    if os.geteuid() != 0:
        pytest.fail("these tests create Unix users (useradd): run them as root, as CI does")
    root = Path(tempfile.mkdtemp(prefix="dbxt-machine-", dir="/tmp"))
    os.chmod(root, 0o755)
    # pytest's tmp folders are root's own (0700): the simulator goes where all may read it.
    shutil.copytree(nvml_lib_dir, root / "nvml")
    os.chmod(root / "nvml", 0o755)
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    made = Machine(root, root / "tmp", root / "nvml", root / "gpus.txt", new_gpu_namespace(), [])
    opened = _open_to_others(
        [Path(sys.executable).resolve(), Path(sys.base_prefix), REPO, VENV_BIN]
    )
    try:
        with opened:
            _check_reachable(made)
            yield made
    finally:
        made.remove_users()
        shutil.rmtree(root, ignore_errors=True)


def _check_reachable(machine: Machine) -> None:
    probe = machine.user("probe")
    done = probe.devbox("--help")
    assert done.returncode == 0, (
        f"another user cannot run devbox from {REPO} with {sys.executable}: {done.stderr}"
        "(the repository and its venv must be readable by all: a umask of 022 when cloning)"
    )


def _snapshot(paths: list[Path]) -> list[tuple[bytes, int, int]]:
    return [(p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns) for p in paths]


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """A bad outcome's whole stderr, which must be one `devbox: error:` line."""
    assert result.returncode != 0, result
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("devbox: error: "), result.stderr
    return result.stderr.strip()


def _old_lock_folder(machine: Machine, owner: OsUser) -> Path:
    """The folder devbox's GPU file locks used, made by `owner` before anyone else; the
    victims' environment still names it, as older versions read it."""
    folder = machine.tmp / "devbox-gpu-locks"
    owner.run("mkdir", "-m", "1777", str(folder))
    for user in machine.users:
        user.env["DEVBOX_GPU_LOCK_DIR"] = str(folder)
    return folder


# --- the GPU locks ----------------------------------------------------------------------


def test_planted_symlinks_do_not_touch_the_victims_files(machine: Machine) -> None:
    uuids = machine.gpus(2)
    alice, mallory = machine.user("alice"), machine.user("mallory")
    notes, profile = alice.home / "notes.txt", alice.home / ".profile"
    for path, mode in ((notes, 0o600), (profile, 0o644)):
        path.write_text(f"alice's own {path.name}\n")
        os.chown(path, alice.uid, alice.uid)
        os.chmod(path, mode)
    before = _snapshot([notes, profile])
    locks = _old_lock_folder(machine, mallory)
    for uuid in uuids:
        mallory.run("ln", "-s", str(notes), str(locks / f"gpu-{uuid}.lock"))
    mallory.run("ln", "-s", str(profile), str(locks / "alloc.lock"))

    box = alice.up("work", "--gpus", "1")

    assert box["gpu_ids"] == [uuids[0]]
    assert _snapshot([notes, profile]) == before  # content, mode and mtime
    assert sorted(p.name for p in locks.iterdir()) == sorted(
        [f"gpu-{u}.lock" for u in uuids] + ["alloc.lock"]
    )  # nothing made or followed there


def test_files_left_lying_around_deny_nothing(machine: Machine) -> None:
    uuids = machine.gpus(2)
    alice, mallory = machine.user("alice"), machine.user("mallory")
    locks = _old_lock_folder(machine, mallory)
    for name in [*(f"gpu-{u}.lock" for u in uuids), "alloc.lock"]:
        mallory.run("install", "-m", "0644", "/dev/null", str(locks / name))
    # Mallory's live process holds the old allocation lock, which stopped every claim.
    holder = mallory.python(
        textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({str(locks / "alloc.lock")!r}, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print(os.getpid(), flush=True)
            time.sleep(600)
        """)
    )
    assert holder.stdout is not None
    holder_pid = int(holder.stdout.readline())
    probe = os.open(locks / "alloc.lock", os.O_RDONLY)
    with pytest.raises(BlockingIOError):  # it really is held
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)

    assert sorted(alice.up("all", "--gpus", "2")["gpu_ids"]) == uuids
    os.kill(holder_pid, signal.SIGKILL)
    holder.wait()


def test_a_live_holder_is_named_and_only_it_denies(machine: Machine) -> None:
    uuids = machine.gpus(3)
    alice, mallory = machine.user("alice"), machine.user("mallory")
    theirs = mallory.up("hers", "--gpus", "1")
    assert theirs["gpu_ids"] == [uuids[0]]
    assert alice.up("mine", "--gpus", "1")["gpu_ids"] == [uuids[1]]  # another GPU
    # A squatter that binds GPU 2's name and never answers: held, but by nobody it names.
    squatter = mallory.python(
        textwrap.dedent(f"""
            import os, socket, time
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(b"\\0{machine.namespace}/{uuids[2]}")
            print(os.getpid(), flush=True)
            time.sleep(600)
        """)
    )
    assert squatter.stdout is not None
    squatter_pid = int(squatter.stdout.readline())

    refused = alice.devbox("up", "more", "--gpus", "1", "--no-attach")

    assert refused.returncode == 1
    her_pid = (mallory.box_dir("hers") / "agent.lock").read_text()
    my_pid = (alice.box_dir("mine") / "agent.lock").read_text()
    assert _error_line(refused) == (
        "devbox: error: asked for 1 GPU(s) but only 0 of 3 are free: "
        f"GPU 0 ({uuids[0]}) is held by uid {mallory.uid} ({mallory.name}), pid {her_pid}; "
        f"GPU 1 ({uuids[1]}) is held by uid {alice.uid} ({alice.name}), pid {my_pid}; "
        f"GPU 2 ({uuids[2]}) is held by a process that does not say who it is"
    )
    assert "more" not in alice.devbox("ls", check=True).stdout

    # A hold lasts exactly as long as its process: the squatter dies, the GPU is free.
    os.kill(squatter_pid, signal.SIGKILL)  # the process itself, not runuser above it
    squatter.wait()
    assert alice.up("more", "--gpus", "1")["gpu_ids"] == [uuids[2]]


# --- private state ----------------------------------------------------------------------


def _denied(user: OsUser, *argv: str) -> None:
    done = user.run(*argv)
    assert done.returncode != 0 and "Permission denied" in done.stderr, (argv, done)


def test_others_cannot_read_the_state_homes_or_logs(machine: Machine) -> None:
    alice, mallory = machine.user("alice"), machine.user("mallory")
    alice.up("secret")
    home = alice.box_dir("secret") / "home"
    wrote = alice.devbox("ssh", "secret", "--", "echo API_KEY=sk-alice > ~/.env")
    assert wrote.returncode == 0, wrote.stderr
    ran = alice.devbox("run", "--box", "secret", "--no-sync", "--", "echo run-output")
    assert ran.returncode == 0 and "run-output" in ran.stdout, ran
    (run_log,) = (alice.box_dir("secret") / "home/.devbox/runs").glob("*/log")

    for path in (
        alice.state,
        alice.box_dir("secret") / "box.json",
        alice.box_dir("secret") / "agent.log",
        home / ".env",
        run_log,
        alice.state / "known_hosts",
    ):
        _denied(mallory, "cat", str(path))
    _denied(mallory, "ls", str(alice.state))
    _assert_private(alice)


def _assert_private(user: OsUser) -> None:
    """devbox's own folders 0700, its files 0600; what the user made in a home is theirs."""
    homes = list((user.state / "local/boxes").glob("*/home"))
    for path in [user.state, *user.state.rglob("*")]:
        if any(home in path.parents for home in homes) and ".devbox" not in path.parts:
            continue
        if path.name == "activity.json":
            # Rewritten every second by agent/server.py under the agent's umask: closed by
            # its 0700 folder (asserted here) until that write goes through devbox.private.
            continue
        st = path.lstat()
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_ISSOCK(st.st_mode):
            continue
        assert stat.S_IMODE(st.st_mode) == want, f"{path} is {stat.S_IMODE(st.st_mode):o}"
        assert st.st_uid == user.uid, path


def test_an_older_open_state_tree_is_closed_on_first_use(machine: Machine) -> None:
    alice, mallory = machine.user("alice"), machine.user("mallory")
    alice.up("old")
    pointer = alice.box_dir("old") / "home/.devbox/probe-socket"
    wait_until(pointer.exists, what="the agent's probe pointer in the home")
    alice.devbox("down", "old", check=True)  # its folder and home stay
    # What an older devbox left: folders 0755, files 0644, and XDG's parents 0755 too.
    opened = alice.run("chmod", "-R", "go+rX", str(alice.state))
    assert opened.returncode == 0, opened.stderr
    for parent in (alice.home / ".local", alice.home / ".local/state"):
        os.chmod(parent, 0o755)
    assert mallory.run("cat", str(alice.box_dir("old") / "agent.log")).returncode == 0

    assert alice.devbox("ls").returncode == 0

    _assert_private(alice)
    _denied(mallory, "cat", str(alice.box_dir("old") / "agent.log"))


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("state folder of another user", "belongs to uid"),
        ("namespace too long", "GPU lock namespace"),
    ],
)
def test_bad_setups_get_one_line(machine: Machine, case: str, expect: str) -> None:
    alice, mallory = machine.user("alice"), machine.user("mallory")
    if case == "state folder of another user":
        shared = machine.tmp / "shared-state"
        mallory.run("mkdir", "-p", "-m", "0777", str(shared / "devbox"))
        alice.env["XDG_STATE_HOME"] = str(shared)
        command = ["ls"]
    else:
        alice.env["DEVBOX_GPU_NAMESPACE"] = "x" * 61
        command = ["up", "b", "--gpus", "1", "--no-attach"]
    assert expect in _error_line(alice.devbox(*command))
