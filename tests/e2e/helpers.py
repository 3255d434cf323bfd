"""What several end-to-end test files ask of a user's boxes, in one place."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devbox import gpulocks, protocol
from tests import nvml_sim
from tests.conftest import User
from tests.waiting import wait_until


def use_multiplexer(user: User, multiplexer: str) -> None:
    """The user's config chooses `multiplexer` (screen, tmux or none) for new boxes."""
    if multiplexer != "none" and shutil.which(multiplexer) is None:
        pytest.skip(f"{multiplexer} is not installed")
    config = user.home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'multiplexer = "{multiplexer}"\n')


def runs_by_id(user: User, box: str) -> dict[str, dict[str, Any]]:
    listed = user.devbox("runs", box, "--json", check=True)
    return {r["id"]: r for r in json.loads(listed.stdout)}


def listed_boxes(user: User) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in json.loads(user.devbox("ls", "--json", check=True).stdout)}


def one_gpu(user: User) -> str:
    """The machine has one simulated GPU, of a UUID no other test uses; returns it."""
    gpu = f"GPU-{uuid.uuid4()}"
    nvml_sim.write(user.gpu_file, [nvml_sim.SimGpu(uuid=gpu)])
    return gpu


def gpu_held(user: User, gpu: str) -> bool:
    """Whether some process holds the GPU's lock name, as the kernel lists it."""
    return bool(gpulocks.held_names(user.env["DEVBOX_GPU_NAMESPACE"], [gpu]))


def start_devbox(user: User, *args: str, foreground_job: bool = False) -> subprocess.Popen[bytes]:
    """`devbox ARGS` as the user, running; stdout and stderr piped. `foreground_job`: in a
    process group of its own whose ctrl-c is never ignored, as a terminal's foreground job
    (the suite's own SIGINT may be ignored: a shell without job control starts `cmd &` so,
    and its children inherit it; a CI run once saw every ctrl-c of a test ignored so)."""
    return subprocess.Popen(
        [sys.executable, "-m", "devbox", *args],
        env=user.env,
        cwd=user.home,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=foreground_job,
        preexec_fn=_default_sigint if foreground_job else None,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the lock, if it was taken
    return True


@contextlib.contextmanager
def impostor_agent(user: User, name: str, tmp_path: Path) -> Iterator[str]:
    """Box `name`'s agent killed and another one, with another host key, answering on its
    port: what only the connection itself shows. Yields the impostor's host-key fingerprint."""
    box = user.box_dir(name)
    port = json.loads((box / "box.json").read_text())["port"]
    os.kill(int((box / "agent.lock").read_text()), signal.SIGKILL)
    # The kill is delivered in the kernel's time: only once the agent is gone is its lock
    # free for the impostor (on a loaded machine it was not yet, and the impostor refused).
    wait_until(lambda: _lock_free(box / "agent.lock"), what="the killed agent's lock to free")
    proc = subprocess.Popen(
        [sys.executable, "-m", "devbox", "agent", "--name", name, "--home", str(tmp_path),
         "--authorized-key", str(box / "authorized_key"),
         "--host-key", str(tmp_path / "impostor_key"), "--port", str(port),
         "--lock-file", str(box / "agent.lock")],
        # Its probe socket's folder goes in the user's short folder, removed after the test.
        env={**user.env, "TMPDIR": user.env["TMUX_TMPDIR"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = protocol.decode(proc.stdout.readline().strip())
        assert ready.type == "ready", ready
        yield str(ready.body["host_key_fingerprint"])
    finally:
        proc.kill()
        proc.wait()
