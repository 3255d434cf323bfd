"""Shared fixtures: every test gets a fresh user (HOME, XDG folders, screen/tmux
sockets, GPU lock namespace) and a simulated NVML, and every box it starts is stopped after."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent import agentfwd
from devbox import private, protocol
from devbox.boxes import session_name
from tests import nvml_sim
from tests.terminal import Terminal

REPO = Path(__file__).resolve().parents[1]
PROMPT = "box-prompt>"  # PS1 adds a space; capture-pane strips it


@pytest.fixture(scope="session")
def nvml_lib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nvml-sim")
    nvml_sim.build(out)
    return out


def ls_table(text: str) -> dict[str, dict[str, str]]:
    """`devbox ls`'s table by box name and column, cut at the header's column starts (a
    cell such as RELEASE "in 4m" holds a space, so words from the end do not line up)."""
    lines = text.splitlines()
    header = lines[0]
    names = header.split()
    starts = [header.index(f" {n}") + 1 if i else 0 for i, n in enumerate(names)]
    ends = [*starts[1:], None]
    return {
        line.split()[0]: {n: line[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)}
        for line in lines[1:]
        if line.strip()
    }


@dataclass
class User:
    """One devbox user on this machine: their environment and a way to run `devbox`."""

    home: Path
    env: dict[str, str]
    gpu_file: Path

    @property
    def state(self) -> Path:
        return self.home / ".local/state/devbox"

    @property
    def ssh_config(self) -> Path:
        return self.home / ".config/devbox/ssh_config"

    def box_dir(self, name: str) -> Path:
        return self.state / "local/boxes" / name

    def gpus(self, count: int) -> None:
        nvml_sim.write_gpus(self.gpu_file, count)

    def devbox(
        self, *args: str, input: bytes | None = None, timeout: float = 60, check: bool = False
    ) -> subprocess.CompletedProcess[bytes]:
        result = subprocess.run(
            [sys.executable, "-m", "devbox", *args],
            env=self.env,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            cwd=self.home,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"devbox {' '.join(args)} failed ({result.returncode}): {result.stderr.decode()}"
            )
        return result

    def up(self, name: str, *extra: str) -> dict[str, Any]:
        """The box's JSON record, as `devbox up --json` prints it."""
        result = self.devbox("up", name, "--no-attach", "--json", *extra, check=True)
        box: dict[str, Any] = json.loads(result.stdout)
        return box

    def ssh(
        self, *args: str, input: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """The real OpenSSH client with the config devbox generated."""
        if not self.ssh_config.exists():
            self.devbox("ssh-config", "--write", check=True)
        return subprocess.run(
            ["ssh", "-F", str(self.ssh_config), *args],
            env=self.env,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )

    def stop_all(self) -> None:
        """Kill every agent of this user and end their screen/tmux sessions."""
        boxes = self.state / "local/boxes"
        if boxes.exists():
            self._stop_boxes(boxes)
        # The short folder for sockets lives in /tmp, outside pytest's cleanup.
        shutil.rmtree(self.env["TMUX_TMPDIR"], ignore_errors=True)

    def _stop_boxes(self, boxes: Path) -> None:
        from devbox.locks import lock_held

        screen, tmux = shutil.which("screen"), shutil.which("tmux")
        keepers = []
        for folder in boxes.iterdir():
            # The box's keeper ends every process of the box (a nohup job too), then itself.
            with contextlib.suppress(OSError, ValueError):
                if lock_held(folder / "keeper.lock"):  # else its pid may be anyone's now
                    os.kill(int((folder / "keeper.lock").read_text().strip()), signal.SIGTERM)
                    keepers.append(folder / "keeper.lock")
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((folder / "agent.lock").read_text().strip()), signal.SIGKILL)
            # A killed agent's stable ssh-agent socket folder, outside pytest's cleanup too.
            relay = agentfwd.stable_path(box=folder.name, home=folder / "home").parent
            shutil.rmtree(relay, ignore_errors=True)
            with contextlib.suppress(OSError):  # a killed agent's probe socket folder
                socket_path = Path((folder / "home/.devbox/probe-socket").read_text().strip())
                private.remove_own_temp_folder(socket_path.parent, protocol.PROBE_FOLDER_PREFIX)
            # Exact: screen's -S matches prefixes, and box "dx" must not end "dx-2"'s.
            session = session_name(folder.name)
            for tool, args in (
                (screen, ["-S", session, "-X", "quit"]),
                (tmux, ["-L", session, "kill-server"]),
            ):
                if tool:
                    subprocess.run([tool, *args], env=self.env, capture_output=True, check=False)
        deadline = time.monotonic() + 30
        while any(lock_held(k) for k in keepers) and time.monotonic() < deadline:
            time.sleep(0.05)


def new_gpu_namespace() -> str:
    """A GPU lock namespace of its own (abstract socket names are machine-wide), so tests
    running at once never see each other's simulated GPUs, which share their UUIDs."""
    return f"dbxt-gpu-{uuid.uuid4().hex[:12]}"


def make_user(root: Path, nvml_dir: Path, *, gpu_namespace: str | None = None) -> User:
    home = root / "home"
    home.mkdir(parents=True)
    # A prompt tests can wait for, whatever the machine's bashrc says.
    for rc in (".bashrc", ".profile"):
        (home / rc).write_text(f"PS1='{PROMPT} '\n")
    # Unix socket paths are short (108 bytes): pytest's tmp paths are too long for them.
    short = Path(tempfile.mkdtemp(prefix="dbx", dir="/tmp"))
    screens = short / "s"
    screens.mkdir(mode=0o700)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("XDG_", "DEVBOX_", "STY", "TMUX", "SSH_"))
    }
    gpu_file = root / "gpus.txt"
    env.update(
        HOME=str(home),
        SCREENDIR=str(screens),
        TMUX_TMPDIR=str(short),
        DEVBOX_GPU_NAMESPACE=gpu_namespace or new_gpu_namespace(),
        DEVBOX_NVML_SIM=str(gpu_file),
        LD_LIBRARY_PATH=str(nvml_dir),
        PYTHONPATH=str(REPO),
        TERM="xterm-256color",
    )
    return User(home=home, env=env, gpu_file=gpu_file)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path, for Unix sockets (108 bytes at most), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="dbx", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def user(tmp_path: Path, nvml_lib_dir: Path) -> Iterator[User]:
    u = make_user(tmp_path / "u1", nvml_lib_dir)
    yield u
    u.stop_all()


@pytest.fixture
def user_factory(tmp_path: Path, nvml_lib_dir: Path) -> Iterator[object]:
    made: list[User] = []

    def factory(label: str, *, gpu_namespace: str | None = None) -> User:
        u = make_user(tmp_path / label, nvml_lib_dir, gpu_namespace=gpu_namespace)
        made.append(u)
        return u

    yield factory
    for u in made:
        u.stop_all()


@pytest.fixture
def term(user: User) -> Iterator[Terminal]:
    """A real terminal (a private tmux server) in the user's environment."""
    t = Terminal(user.env, Path(user.env["TMUX_TMPDIR"]))
    yield t
    t.close()


@pytest.fixture(params=["openssh", "builtin"])
def ssh_client(request: pytest.FixtureRequest, user: User) -> str:
    """Runs a test with each of `devbox ssh`'s clients: OpenSSH when installed (the fast
    path) and devbox's own asyncssh client (machines without OpenSSH)."""
    if request.param == "builtin":
        user.env["DEVBOX_SSH_CLIENT"] = "builtin"
    elif shutil.which("ssh") is None:
        pytest.skip("the OpenSSH client is not installed")
    return str(request.param)
