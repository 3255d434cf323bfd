"""A local box's GPUs stay taken while any process of the box lives, `down` ends them all
(and only them), and a home is deleted only after a yes (issue 16).

Real agents, real screen/tmux, real processes: a box's processes are found in /proc by
their command line, a word no other process has."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from devbox.locks import lock_held
from tests.conftest import User
from tests.e2e.helpers import gpu_held, listed_boxes, one_gpu
from tests.terminal import Terminal
from tests.waiting import wait_until


def _pids_running(word: str) -> list[int]:
    """Live processes whose command line holds `word` (zombies have none)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if word.encode() in argv:
            found.append(int(entry))
    return found


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def _kill_agent(user: User, name: str) -> None:
    os.kill(int((user.box_dir(name) / "agent.lock").read_text()), signal.SIGKILL)
    wait_until(lambda: not lock_held(user.box_dir(name) / "agent.lock"), what="the agent's end")


def _use_multiplexer(user: User, kind: str) -> None:
    config = user.home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'multiplexer = "{kind}"\n')


def _sleeper() -> tuple[str, str]:
    """A sleep command with a length no other process uses, and that length to find it by."""
    seconds = str(100000 + uuid.uuid4().int % 800000)
    return f"sleep {seconds}", seconds


def _refused_while_held(user: User, gpu: str) -> str:
    """The GPU is held: a claim on this 1-GPU machine is refused, saying by whom."""
    assert gpu_held(user, gpu)
    refused = user.devbox("up", "second", "--gpus", "1", "--no-attach")
    assert refused.returncode == 1, refused.stderr
    assert b"only 0 of 1 are free" in refused.stderr
    assert "second" not in listed_boxes(user)
    return refused.stderr.decode()


# --- defect 1: a GPU is free only when no process of the box can use it -----------------


@pytest.mark.parametrize("kind", ["screen", "tmux"])
def test_a_session_that_outlives_its_killed_agent_keeps_the_gpu(
    user: User, term: Terminal, kind: str
) -> None:
    if shutil.which(kind) is None:
        pytest.skip(f"{kind} is not installed")
    _use_multiplexer(user, kind)
    gpu = one_gpu(user)
    user.up("train", "--gpus", "1")
    window = term.start(f"{sys.executable} -m devbox ssh train")
    term.wait_for(window, "box-prompt>")
    command, word = _sleeper()
    term.type(window, command)  # training, in the box's persistent session
    pid = wait_until(lambda: _pids_running(word), what="the session's job")[0]
    assert _environ(pid)["CUDA_VISIBLE_DEVICES"] == gpu

    _kill_agent(user, "train")

    assert _pids_running(word) == [pid]  # the session's server was never the agent's to end
    box = listed_boxes(user)["train"]
    assert box["state"] == "failed"
    # The session's server, its shell and the job, counted.
    assert re.search(
        r"; [1-9]\d* process\(es\) still hold its GPUs; `devbox down` ends them$",
        str(box["reason"]),
    )
    assert "GPUs freed" not in str(box["reason"])
    refusal = _refused_while_held(user, gpu)
    # The holder it names is alive: the keeper, which listens on the name once the agent died.
    keeper = (user.box_dir("train") / "keeper.lock").read_text()
    assert f"pid {keeper}" in refusal and lock_held(user.box_dir("train") / "keeper.lock")

    assert user.devbox("down", "train").returncode == 0
    assert _pids_running(word) == []  # down waited until the session's processes were gone
    assert not gpu_held(user, gpu)
    assert user.up("second", "--gpus", "1")["gpu_ids"] == [gpu]


def test_down_ends_a_nohup_job_and_only_the_boxs(user: User) -> None:
    gpu = one_gpu(user)
    user.up("mine", "--gpus", "1")
    user.up("other")  # a second box of the same user
    mine_cmd, mine_word = _sleeper()
    other_cmd, other_word = _sleeper()
    for box, command in (("mine", mine_cmd), ("other", other_cmd)):
        done = user.devbox("ssh", box, "--", f"nohup {command} >/dev/null 2>&1 &")
        assert done.returncode == 0, done.stderr
    mine = wait_until(lambda: _pids_running(mine_word), what="the nohup job")
    others = wait_until(lambda: _pids_running(other_word), what="the other box's job")
    assert _environ(mine[0])["CUDA_VISIBLE_DEVICES"] == gpu

    assert user.devbox("down", "mine").returncode == 0

    assert _pids_running(mine_word) == []
    assert not gpu_held(user, gpu)
    assert _pids_running(other_word) == others  # another box's process is not this box's
    assert listed_boxes(user)["other"]["state"] == "running"


def test_without_a_multiplexer_a_detached_job_keeps_the_gpu_until_down(user: User) -> None:
    _use_multiplexer(user, "none")
    gpu = one_gpu(user)
    box = user.up("plain", "--gpus", "1")
    assert box["multiplexer"] == "none"
    command, word = _sleeper()
    # A job started the way one would without screen: detached, in a session of its own.
    detach = f"setsid nohup {command} >/dev/null 2>&1 < /dev/null &"
    assert user.devbox("ssh", "plain", "--", detach).returncode == 0
    wait_until(lambda: _pids_running(word), what="the detached job")

    _kill_agent(user, "plain")

    assert len(_pids_running(word)) == 1
    assert "1 process(es) still hold its GPUs" in str(listed_boxes(user)["plain"]["reason"])
    _refused_while_held(user, gpu)
    assert user.devbox("down", "plain").returncode == 0
    assert _pids_running(word) == []
    assert not gpu_held(user, gpu)


def test_a_box_whose_processes_all_ended_frees_its_gpu_at_once(user: User) -> None:
    gpu = one_gpu(user)
    user.up("short", "--gpus", "1")
    _kill_agent(user, "short")
    # Nothing else ran in it: the keeper has no process left to wait for.
    wait_until(lambda: not lock_held(user.box_dir("short") / "keeper.lock"), what="keeper end")
    assert not gpu_held(user, gpu)
    assert "GPUs freed" in str(listed_boxes(user)["short"]["reason"])


# --- defect 9: destroying a home asks first ---------------------------------------------


def _home_file(user: User, name: str) -> Path:
    path = user.box_dir(name) / "home" / "results.txt"
    path.write_text("a week of training\n")
    return path


def _one_line(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    assert err.startswith("devbox: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_purge_without_a_terminal_needs_yes(user: User) -> None:
    user.up("work")
    results = _home_file(user, "work")
    err = _one_line(user.devbox("down", "work", "--purge"), 2)
    assert "--yes" in err
    assert results.exists() and listed_boxes(user)["work"]["state"] == "running"  # nothing changed

    done = user.devbox("down", "work", "--purge", "--yes")
    assert done.returncode == 0, done.stderr
    assert not user.box_dir("work").exists() and "work" not in listed_boxes(user)


def test_purge_asks_on_a_terminal(user: User, term: Terminal) -> None:
    user.up("work")
    results = _home_file(user, "work")
    devbox = f"{sys.executable} -m devbox"
    window = term.start(f"{devbox} down work --purge")
    term.wait_for(window, "[y/N]")
    term.type(window, "n")
    screen = term.wait_for(window, "EXIT=")
    assert "not confirmed: nothing was changed" in screen and "EXIT=1" in screen
    assert results.exists() and listed_boxes(user)["work"]["state"] == "running"

    window = term.start(f"{devbox} down work --purge")
    assert "delete the home of box work (/" in term.wait_for(window, "[y/N]")
    term.type(window, "y")
    assert "EXIT=0" in term.wait_for(window, "EXIT=")
    assert not user.box_dir("work").exists() and "work" not in listed_boxes(user)


def test_the_kept_home_of_a_released_box_can_be_purged(user: User) -> None:
    user.up("old")
    results = _home_file(user, "old")
    assert user.devbox("down", "old").returncode == 0
    assert results.exists()  # kept

    _one_line(user.devbox("down", "old", "--purge"), 2)  # no terminal, no --yes
    assert results.exists()
    done = user.devbox("down", "old", "--purge", "--yes")
    assert done.returncode == 0 and b"kept home is deleted" in done.stderr
    assert not user.box_dir("old").exists()
    assert "no box named 'old'" in _one_line(user.devbox("down", "old", "--purge", "--yes"), 2)
    assert "no box named 'old'" in _one_line(user.devbox("down", "old"), 2)


# --- defect 14e: a failed claim leaves nothing that completion offers -------------------


def test_a_refused_claim_leaves_no_box_folder(user: User) -> None:
    one_gpu(user)
    user.up("first", "--gpus", "1")
    user.up("kept")
    results = _home_file(user, "kept")
    assert user.devbox("down", "kept").returncode == 0

    for name in ("nogpu", "kept"):  # a new name, and the name of a kept home
        refused = user.devbox("up", name, "--gpus", "1", "--no-attach")
        assert refused.returncode == 1, refused.stderr
    assert not user.box_dir("nogpu").exists()
    assert results.exists()  # the kept home is the user's: a failed claim leaves it

    offered = user.devbox("_complete", "boxes", check=True).stdout.decode().split()
    assert offered == ["first"]
