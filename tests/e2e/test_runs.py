"""`devbox run` against real boxes: real screen/tmux windows, real rsync and ssh, real
processes killed for real. The run outlives its client; its log and exit status stay."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devbox.backends.local import keeper as keeper_mod
from tests.conftest import User
from tests.e2e.helpers import runs_by_id, use_multiplexer
from tests.terminal import Terminal

DEVBOX = f"{sys.executable} -m devbox"


def _wait_state(
    user: User, box: str, run_id: str, state: str, timeout: float = 30
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        run = runs_by_id(user, box)[run_id]
        if run["state"] == state:
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} is {run['state']}, never {state}: {run}")
        time.sleep(0.2)


def _activity_runs(user: User, box: str) -> int:
    data = json.loads((user.box_dir(box) / "activity.json").read_text())
    return int(data.get("runs", 0))


def _wait_activity(user: User, box: str, runs: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while _activity_runs(user, box) != runs:
        if time.monotonic() > deadline:
            raise AssertionError(f"the agent counts {_activity_runs(user, box)} runs, not {runs}")
        time.sleep(0.2)


def _git_tree(path: Path) -> str:
    (path / "sub").mkdir(parents=True)
    (path / "train.py").write_text("import sys; print('epoch', sys.argv[1], flush=True)\n")
    (path / "sub/data.txt").write_text("data\n")
    (path / ".gitignore").write_text("outputs/\n*.ckpt\n")
    (path / "outputs").mkdir()
    (path / "outputs/big.bin").write_text("not synced")
    (path / "model.ckpt").write_text("not synced")
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env = {**os.environ, **who, "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "first"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True, env=env)
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True)
    return head.stdout.decode().strip()


@pytest.mark.parametrize("multiplexer", ["screen", "tmux", "none"])
def test_a_run_outlives_its_killed_client(user: User, tmp_path: Path, multiplexer: str) -> None:
    use_multiplexer(user, multiplexer)
    user.up("exp")
    project = tmp_path / "proj"
    commit = _git_tree(project)
    client = subprocess.Popen(
        [sys.executable, "-m", "devbox", "run", "--box", "exp", "--sync", str(project), "--",
         "python3 train.py 1; until [ -e go ]; do sleep 0.1; done; python3 train.py 2; exit 7"],
        env=user.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: killed whole, like a closed laptop
    )  # fmt: skip
    assert client.stdout is not None and client.stderr is not None
    assert client.stdout.readline().strip() == b"epoch 1"
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    said = client.stderr.read().decode()
    run_id = re.search(r"run (\w+) on box exp", said)
    assert run_id, said
    rid = run_id.group(1)

    running = runs_by_id(user, "exp")[rid]
    assert running["state"] == "running"
    _wait_activity(user, "exp", 1)  # a running experiment is activity for the autoscaler
    (user.box_dir("exp") / "home/proj/go").touch()  # now it may end
    ended = _wait_state(user, "exp", rid, "failed")
    assert ended["exit_code"] == 7 and ended["signal"] is None
    assert ended["git_commit"] == commit and ended["git_dirty"] is False
    assert ended["command"].endswith("exit 7") and ended["cwd"].endswith("/proj")
    assert ended["gpus"] == ""  # a box without GPUs sees none
    assert ended["started_at"] <= ended["ended_at"]
    assert ended["multiplexer"] == ("" if multiplexer == "none" else multiplexer)
    _wait_activity(user, "exp", 0)

    log = user.devbox("logs", "exp", rid, check=True).stdout
    assert b"epoch 1" in log and b"epoch 2" in log
    table = user.devbox("runs", "exp", check=True).stdout.decode()
    row = next(line for line in table.splitlines() if rid in line)
    assert "failed" in row and "exit 7" in row and commit[:10] in row


def test_following_ends_with_the_run_its_status_and_a_notification(
    user: User, tmp_path: Path, ssh_client: str
) -> None:
    user.up("fol")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    said = tmp_path / "notified"
    fake = bin_dir / "notify-send"
    fake.write_text(f'#!/bin/sh\nprintf "%s|" "$@" >> {said}\n')
    fake.chmod(0o755)
    user.env["PATH"] = f"{bin_dir}:{user.env['PATH']}"
    done = user.devbox("run", "--box", "fol", "--no-sync", "--", "echo out; echo err >&2; exit 3")
    assert done.returncode == 3
    assert done.stdout.replace(b"\r\n", b"\n") == b"out\nerr\n"
    assert b"ended: exit 3" in done.stderr
    assert re.search(r"devbox: run \w+ ended with status 3\|on box fol\|", said.read_text())
    ok = user.devbox("run", "--box", "fol", "--no-sync", "--", "true")
    assert ok.returncode == 0 and "finished|on box fol|" in said.read_text()

    detached = user.devbox("run", "--box", "fol", "--no-sync", "-d", "--", "sleep 30")
    assert detached.returncode == 0
    rid = detached.stdout.decode().strip()
    assert runs_by_id(user, "fol")[rid]["state"] == "running"
    assert user.devbox("kill", "fol", rid).returncode == 0
    killed = runs_by_id(user, "fol")[rid]
    assert killed["state"] == "killed" and killed["signal"] == "TERM"
    again = user.devbox("kill", "fol", rid)
    assert again.returncode == 2 and b"is not running" in again.stderr


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_a_second_sync_sends_only_what_changed(user: User, tmp_path: Path, method: str) -> None:
    if method == "rsync" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    user.env["DEVBOX_SYNC"] = method
    user.up("syn")
    project = tmp_path / "proj"
    _git_tree(project)
    for i in range(30):
        (project / f"sub/f{i}.txt").write_text(f"file {i}\n")
    first = user.devbox("sync", "syn", str(project), check=True).stderr.decode()
    assert "synced 33 changed files" in first and f"({method})" in first
    there = user.box_dir("syn") / "home/proj"
    assert (there / "sub/f7.txt").read_text() == "file 7\n"
    assert not (there / ".git").exists()
    assert not (there / "outputs").exists() and not (there / "model.ckpt").exists()
    before = {p: p.stat().st_ctime_ns for p in there.rglob("*") if p.is_file()}

    time.sleep(0.01)
    (project / "sub/f7.txt").write_text("changed, and longer\n")
    second = user.devbox("sync", "syn", str(project), check=True).stderr.decode()
    assert "synced 1 changed file (sub/f7.txt)" in second
    assert (there / "sub/f7.txt").read_text() == "changed, and longer\n"
    after = {p: p.stat().st_ctime_ns for p in there.rglob("*") if p.is_file()}
    touched = {p.relative_to(there).as_posix() for p in after if after[p] != before.get(p)}
    assert touched == {"sub/f7.txt"}
    third = user.devbox("sync", "syn", str(project), check=True).stderr.decode()
    assert "synced 0 changed files" in third


def test_sync_falls_back_to_sftp_when_the_box_lacks_rsync(user: User, tmp_path: Path) -> None:
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    bare = tmp_path / "bin-without-rsync"
    bare.mkdir()
    for tool in ("sh", "bash", "screen", "cat", "sleep", "env"):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    full_path = user.env["PATH"]
    user.env["PATH"] = str(bare)  # the agent inherits it: no rsync in the box
    user.up("norsync")
    user.env["PATH"] = full_path
    project = tmp_path / "proj"
    _git_tree(project)
    synced = user.devbox(
        "run", "--box", "norsync", "--sync", str(project), "--", "cat sub/data.txt"
    )
    assert synced.returncode == 0, synced.stderr
    assert b"(sftp)" in synced.stderr and synced.stdout.strip() == b"data"


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_ctrl_c_detaches_and_attach_and_kill(user: User, term: Terminal, multiplexer: str) -> None:
    use_multiplexer(user, multiplexer)
    user.up("att")
    ticks = "for i in $(seq 1000); do echo tick-$i; sleep 0.2; done"
    first = term.start(f"{DEVBOX} run --box att --no-sync -- '{ticks}'")
    term.wait_for(first, "tick-3")
    term.send(first, "C-c")
    shown = term.wait_for(first, "EXIT=0")
    assert "detached from run" in shown and "devbox attach att" in shown
    rid = re.search(r"devbox logs att (\w+) -f", shown.replace("\n", ""))
    assert rid, shown
    run_id = rid.group(1)
    assert runs_by_id(user, "att")[run_id]["state"] == "running"

    joined = term.start(f"{DEVBOX} attach att {run_id}")
    seen = term.wait_for(joined, "tick-")
    last = max(int(n) for n in re.findall(r"tick-(\d+)", seen))
    term.wait_for(joined, f"tick-{last + 2}")  # live: the window keeps printing
    term.send(joined, *(["C-a", "d"] if multiplexer == "screen" else ["C-b", "d"]))
    term.wait_for(joined, "EXIT=0")

    assert user.devbox("kill", "att", run_id).returncode == 0
    assert runs_by_id(user, "att")[run_id]["state"] == "killed"
    gone = user.devbox("attach", "att", run_id)
    assert gone.returncode == 2  # no terminal: said before it even asks the box


def _one_line_error(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    assert err.startswith("devbox: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_gets_one_line(user: User, tmp_path: Path) -> None:
    user.up("bad")
    for args in (
        ["run", "--box", "nosuch", "--no-sync", "--", "true"],
        ["runs", "nosuch"],
        ["logs", "nosuch", "abcd"],
        ["kill", "nosuch", "abcd"],
        ["sync", "nosuch", str(tmp_path)],
    ):
        assert "no box named 'nosuch'" in _one_line_error(user.devbox(*args), 2)
    for args in (["logs", "bad", "zzzz"], ["kill", "bad", "zzzz"], ["logs", "bad", "zzzz", "-f"]):
        assert "no run 'zzzz' in box bad" in _one_line_error(user.devbox(*args), 2)
    assert "not a run id" in _one_line_error(user.devbox("logs", "bad", "../x"), 2)
    assert "nothing to run" in _one_line_error(user.devbox("run", "--box", "bad"), 2)
    missing = tmp_path / "missing"
    err = _one_line_error(
        user.devbox("run", "--box", "bad", "--sync", str(missing), "--", "true"), 2
    )
    assert "no such folder" in err

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    argv = [
        sys.executable,
        "-m",
        "devbox",
        "run",
        "--box",
        "bad",
        "--sync",
        str(locked),
        "--",
        "true",
    ]
    if os.geteuid() == 0:
        # Root reads anything through its DAC capabilities: drop those two and stay root,
        # which still reaches the checkout and the venv wherever they are (a user of
        # its own, such as nobody, could not when the clone sits in a 0700 folder).
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *argv]
    denied = subprocess.run(argv, env=user.env, capture_output=True, cwd="/", timeout=30)
    assert "permission denied" in _one_line_error(denied, 2)
    assert runs_by_id(user, "bad") == {}  # nothing was started by any of it


def test_a_failed_sync_starts_nothing_and_leaves_no_helper(user: User, tmp_path: Path) -> None:
    """The helper of a followed run starts in the box while the tree syncs (GatedStart);
    when the sync fails it must end without starting the run."""
    user.up("gate")
    project = tmp_path / "proj"
    _git_tree(project)
    # Where the tree would go in the box is a file: rsync cannot make the folder.
    (user.box_dir("gate") / "home" / "proj").write_text("in the way\n")
    done = user.devbox("run", "--box", "gate", "--sync", str(project), "--", "echo ran")
    err = _one_line_error(done, 1)
    assert "syncing" in err and b"ran" not in done.stdout
    assert runs_by_id(user, "gate") == {}
    keeper = int((user.box_dir("gate") / "keeper.lock").read_text())
    left = [_cmdline(pid) for pid in keeper_mod.descendants(keeper)]
    assert not [cmd for cmd in left if b"boxside" in cmd], left


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended since it was listed
        return b""


def test_a_run_records_and_sees_the_boxs_gpus(user: User) -> None:
    user.gpus(3)
    box = user.up("gpu", "--gpus", "2")
    uuids = ",".join(box["gpu_ids"])
    seen = user.devbox("run", "--box", "gpu", "--no-sync", "--", "echo $CUDA_VISIBLE_DEVICES")
    assert seen.returncode == 0 and seen.stdout.strip().decode() == uuids
    (run,) = runs_by_id(user, "gpu").values()
    assert run["gpus"] == uuids and run["git_commit"] is None and run["source"] == ""
