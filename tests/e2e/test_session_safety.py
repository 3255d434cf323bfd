"""Never lose or disturb the user's work (issue 16): each box's session is addressed exactly,
a client that goes away leaves its background jobs running, and a persistent session always
has a login window that is not a run's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devbox.boxes import Multiplexer, session_name
from tests.conftest import PROMPT, User
from tests.e2e.helpers import runs_by_id, use_multiplexer
from tests.terminal import Terminal
from tests.waiting import wait_until

DEVBOX = f"{sys.executable} -m devbox"


def _start_run(user: User, box: str, command: str) -> dict[str, Any]:
    """A detached run, once its command is running (its pid is recorded)."""
    started = user.devbox("run", "--box", box, "--no-sync", "-d", "--", command, check=True)
    rid = started.stdout.decode().strip()
    run: dict[str, Any] = wait_until(
        lambda: (found := runs_by_id(user, box)[rid])["pid"] and found, what=f"run {rid} to start"
    )
    return run


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _session_of(pid: int) -> str:
    """The screen or tmux session a process runs in, as its environment names it."""
    env = dict(
        line.split("=", 1)
        for line in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in line
    )
    return env.get("STY") or env.get("TMUX", "")


# --- 2: a box's name is nobody else's prefix ------------------------------------------------


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_down_and_run_touch_only_their_own_box_not_a_longer_named_one(
    user: User, multiplexer: str
) -> None:
    use_multiplexer(user, multiplexer)
    for name in ("dx", "dx-2", "dy", "dy-2"):
        user.up(name)  # --no-attach: none of them has a session yet
    busy = _start_run(user, "dx-2", "sleep 300")
    user.devbox("down", "dx", check=True)  # dx has no session: nothing of dx-2's may go
    assert runs_by_id(user, "dx-2")[busy["id"]]["state"] == "running"
    assert _alive(busy["pid"])

    _start_run(user, "dy-2", "sleep 300")  # dy-2's session exists, dy's does not
    mine = _start_run(user, "dy", "sleep 300")
    where = _session_of(mine["pid"])
    assert "devbox-dy" in where and "devbox-dy-2" not in where, where


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_ending_and_telling_a_box_leave_a_longer_named_box_alone(
    user: User, multiplexer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the autoscaler's warning and release (and `devbox down`) go through."""
    path = shutil.which(multiplexer)
    if path is None:
        pytest.skip(f"{multiplexer} is not installed")
    for key in ("SCREENDIR", "TMUX_TMPDIR"):
        monkeypatch.setenv(key, user.env[key])
    monkeypatch.delenv("STY", raising=False)
    monkeypatch.delenv("TMUX", raising=False)
    mux = Multiplexer(multiplexer, path)

    def start(session: str) -> None:
        argv = (
            [path, "-dmS", session, "sleep", "300"]
            if multiplexer == "screen"
            else [path, "-L", session, "new-session", "-d", "-s", "main", "sleep 300"]
        )
        subprocess.run(argv, check=True, env=os.environ)

    def legacy_running(session: str) -> bool:
        if multiplexer == "tmux":
            return subprocess.run([path, "-L", session, "has-session"]).returncode == 0
        listed = subprocess.run([path, "-ls"], capture_output=True, text=True).stdout
        return f".{session}\t" in listed

    start(session_name("zq-2"))
    # Sessions an agent from before the ".box" names started: "devbox-zq" is zq's.
    start("devbox-zq")
    start("devbox-zq-2")
    try:
        wait_until(lambda: mux.running("zq-2"), what="zq-2's session")
        wait_until(lambda: legacy_running("devbox-zq-2"), what="zq-2's old session")
        assert not mux.running("zq")
        mux.tell("zq", "devbox: box zq has been idle")
        mux.end("zq", timeout=1.0)
        assert mux.running("zq-2")
        assert legacy_running("devbox-zq-2")
        assert not legacy_running("devbox-zq")
    finally:
        mux.end("zq-2")
        mux.end("zq")
    assert not legacy_running("devbox-zq-2")


# --- 7: a client that goes away leaves background jobs running --------------------------------


def _pid_in(path: Path) -> int:
    """The pid a job wrote (with echo: one write, so a whole line or nothing)."""

    def written() -> int | None:
        text = path.read_text() if path.exists() else ""
        return int(text) if text.endswith("\n") else None

    return int(wait_until(written, what=str(path)))


def _clients(user: User, box: str) -> int:
    return int(json.loads((user.box_dir(box) / "activity.json").read_text()).get("clients", 0))


def test_background_jobs_outlive_their_client_without_a_terminal(user: User) -> None:
    user.up("bg")
    user.devbox("ssh-config", "--write", check=True)
    home = user.home  # where sessions start
    job = "sh -c 'echo $$ > {0}; exec sleep 300' >/dev/null 2>&1 &"

    # The command returns at once; its job goes on.
    done = user.ssh("bg.devbox", job.format("quick.pid"))
    assert done.returncode == 0, done.stderr
    quick = _pid_in(home / "quick.pid")
    wait_until(lambda: _clients(user, "bg") == 0, what="the agent to see the client go")

    # The client is killed (a laptop closed) while the command is still in its foreground.
    client = subprocess.Popen(
        ["ssh", "-F", str(user.ssh_config), "bg.devbox",
         job.format("killed.pid") + " echo started; sleep 100"],
        env=user.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own group: ssh and its ProxyCommand die together
    )  # fmt: skip
    assert client.stdout is not None
    assert client.stdout.readline().strip() == b"started"
    killed = _pid_in(home / "killed.pid")
    os.killpg(client.pid, signal.SIGKILL)
    client.wait()
    wait_until(lambda: _clients(user, "bg") == 0, what="the agent to see the client go")
    # A later connection sees both jobs, as under sshd.
    seen = user.ssh("bg.devbox", f"kill -0 {quick} && echo quick; kill -0 {killed} && echo killed")
    assert seen.stdout == b"quick\nkilled\n", seen.stderr
    assert _alive(quick) and _alive(killed)
    os.kill(quick, signal.SIGTERM)
    os.kill(killed, signal.SIGTERM)


# --- 8: the session's login window is never a run's --------------------------------------------


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_ssh_into_a_box_a_run_started_lands_on_a_shell_not_the_run(
    user: User, term: Terminal, multiplexer: str
) -> None:
    use_multiplexer(user, multiplexer)
    user.up("fresh")  # --no-attach: the run makes the session
    run = _start_run(user, "fresh", "echo run-output-$((6*7)); sleep 300")
    target = term.start(f"{DEVBOX} ssh fresh")
    term.wait_for(target, PROMPT)
    term.type(target, "echo login-$((7*6))x")
    term.wait_for(target, "login-42x")
    assert "run-output-42" not in term.screen(target)
    _ctrl_c_at_prompt(term, target)
    term.type(target, "echo still-$((6*7))y")
    term.wait_for(target, "still-42y")
    assert runs_by_id(user, "fresh")[run["id"]]["state"] == "running"
    assert _alive(run["pid"])

    # Joining the run's window and leaving it does not make the next ssh land there.
    term.kill_window(target)
    again = term.start(f"{DEVBOX} attach fresh {run['id']}")
    term.wait_for(again, "run-output-42")
    term.kill_window(again)
    back = term.start(f"{DEVBOX} ssh fresh")
    term.wait_for(back, PROMPT)
    assert "run-output-42" not in term.screen(back)


def _ctrl_c_at_prompt(term: Terminal, target: str) -> None:
    """ctrl-c, then the shell's next prompt: keys typed before it are dropped by readline
    as it handles the interrupt (a loaded machine once lost the first letter so)."""
    prompts = term.screen(target).count(PROMPT)
    term.send(target, "C-c")
    wait_until(lambda: term.screen(target).count(PROMPT) > prompts, 15, "the prompt after ctrl-c")


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_a_run_started_while_attached_does_not_take_the_users_window(
    user: User, term: Terminal, multiplexer: str
) -> None:
    use_multiplexer(user, multiplexer)
    user.up("busy")
    target = term.start(f"{DEVBOX} ssh busy")
    term.wait_for(target, PROMPT)
    run = _start_run(user, "busy", "echo run-output-$((6*7)); sleep 300")
    term.type(target, "echo typed-$((7*6))z")
    term.wait_for(target, "typed-42z")
    assert "run-output-42" not in term.screen(target)
    _ctrl_c_at_prompt(term, target)  # at the user's own prompt: nothing of the run's
    term.type(target, "echo after-$((6*7))c")
    term.wait_for(target, "after-42c")
    assert runs_by_id(user, "busy")[run["id"]]["state"] == "running"
    assert _alive(run["pid"])


# --- 14d: no persistent session is said at `up` ------------------------------------------------


def test_up_says_when_the_box_has_no_persistent_session(user: User, tmp_path: Path) -> None:
    empty = tmp_path / "bin-without-screen-or-tmux"
    empty.mkdir()
    user.env["PATH"] = str(empty)  # the agent inherits it and finds neither
    said = user.devbox("up", "bare", "--no-attach", check=True).stderr.decode()
    lines = [line for line in said.splitlines() if "no screen or tmux" in line]
    assert len(lines) == 1, said
    assert "will not survive a disconnect" in lines[0] and "install screen or tmux" in lines[0]

    use_multiplexer(user, "none")  # chosen: a plain shell is what the user asked for
    quiet = user.devbox("up", "chosen", "--no-attach", check=True).stderr.decode()
    assert "no screen or tmux" not in quiet, quiet
