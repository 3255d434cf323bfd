"""A box behaves as an OpenSSH sshd host: sessions start in $HOME and every tool means the
same by `~`, `ssh host CMD` reads ~/.bashrc with sshd's environment, and `ssh -A` reaches
the client's agent, in the persistent session too (through a stable socket that follows
the latest attached client). The real OpenSSH client, ssh-agent, git, rsync, screen, tmux."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PROMPT, User
from tests.e2e.helpers import use_multiplexer
from tests.terminal import Terminal
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client missing")


def _run(user: User, *argv: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(
        list(argv), env=user.env, input=input, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, (argv, done.stderr.decode())
    return done


def test_sessions_start_in_home_and_every_tool_agrees_on_tilde(user: User, tmp_path: Path) -> None:
    user.up("b1")
    home = user.home
    assert user.ssh("b1.devbox", "pwd").stdout.decode().strip() == str(home)
    cfg = ["-F", str(user.ssh_config)]
    payload = tmp_path / "payload.txt"
    payload.write_text("the same file\n")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(1 << 16))

    _run(user, "scp", *cfg, str(big), "b1.devbox:~/big.bin")
    # A copy is the user at work: SFTP/scp traffic reaches the activity record.
    activity = user.box_dir("b1") / "activity.json"
    wait_until(lambda: json.loads(activity.read_text()).get("last_sftp", 0) > 0, what="sftp use")
    _run(user, "scp", *cfg, str(payload), "b1.devbox:~/by-scp")  # scp over SFTP
    _run(user, "scp", "-O", *cfg, str(payload), "b1.devbox:~/by-scp-O")  # the old protocol
    _run(user, "scp", "-O", *cfg, "b1.devbox:~/by-scp", str(tmp_path / "back-O"))
    batch = f"put {payload} by-sftp\nget by-scp-O {tmp_path / 'back-sftp'}\n"
    _run(user, "sftp", *cfg, "-b", "-", "b1.devbox", input=batch.encode())
    copied = ["by-scp", "by-scp-O", "by-sftp"]
    if shutil.which("rsync"):
        (tmp_path / "by-rsync").write_text("the same file\n")
        _run(user, "rsync", "-e", f"ssh {' '.join(cfg)}", str(tmp_path / "by-rsync"), "b1.devbox:")
        copied.append("by-rsync")
    for name in copied:
        assert (home / name).read_text() == "the same file\n", name
        assert not (user.box_dir("b1") / "home" / name).exists()
    assert (tmp_path / "back-O").read_text() == (tmp_path / "back-sftp").read_text()
    shown = user.ssh("b1.devbox", "cat " + " ".join(f"~/{n}" for n in copied))
    assert shown.stdout.decode() == "the same file\n" * len(copied)

    # git push NAME.devbox:r.git reaches the bare ~/r.git.
    assert user.ssh("b1.devbox", "git init -q --bare ~/r.git").returncode == 0
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    _run(user, *git, "init", "-q")
    _run(user, *git, "add", "a.txt")
    _run(user, *git, "commit", "-q", "-m", "first")
    user.env["GIT_SSH_COMMAND"] = f"ssh {' '.join(cfg)}"
    _run(user, *git, "push", "-q", "b1.devbox:r.git", "HEAD:refs/heads/main")
    pushed = _run(user, "git", "--git-dir", str(home / "r.git"), "rev-parse", "main")
    assert pushed.stdout == _run(user, *git, "rev-parse", "HEAD").stdout


def test_remote_commands_read_bashrc_with_sshds_environment(user: User) -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    # conda init's block sits at the top of ~/.bashrc, before Debian's interactivity guard.
    (user.home / ".bashrc").write_text(
        "export CONDA_LIKE=on\ncase $- in *i*) ;; *) return;; esac\nPS1='" + PROMPT + " '\n"
    )
    user.env["SHLVL"] = "3"  # devbox started from a nested shell: the agent inherits it
    box = user.up("rc")
    if "bash" not in user.ssh("rc.devbox", "echo $0").stdout.decode():
        pytest.skip("the login shell is not bash")
    seen = user.ssh("rc.devbox", 'echo "$CONDA_LIKE $SHLVL [$SSH_CLIENT] [$SSH_TTY]"')
    assert seen.returncode == 0, seen.stderr
    conda, shlvl, rest = seen.stdout.decode().strip().split(" ", 2)
    assert (conda, shlvl) == ("on", "1")
    client = re.fullmatch(r"\[127\.0\.0\.1 (\d+) (\d+)\] \[\]", rest)
    assert client and int(client.group(2)) == box["port"], rest

    tty = user.ssh("-tt", "rc.devbox", 'echo "tty=$SSH_TTY $(tty)"')
    assert tty.returncode == 0, tty.stderr
    named, actual = tty.stdout.decode().strip().removeprefix("tty=").split()
    assert named == actual and named.startswith("/dev/pts/")


@pytest.fixture
def agents(short_tmp: Path) -> Iterator[dict[str, Path]]:
    """Two real ssh-agents, each holding one generated key (its comment is its name)."""
    procs = []
    socks: dict[str, Path] = {}
    try:
        for name in ("key-one", "key-two"):
            key = short_tmp / name
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
                check=True,
            )
            sock = short_tmp / f"{name}.sock"
            procs.append(
                subprocess.Popen(
                    ["ssh-agent", "-D", "-a", str(sock)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_until(functools.partial(_listening, sock), what=f"{name}'s ssh-agent")
            env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
            subprocess.run(["ssh-add", "-q", str(key)], env=env, check=True, capture_output=True)
            socks[name] = sock
        yield socks
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def test_ssh_a_reaches_the_clients_agent_in_a_command(user: User, agents: dict[str, Path]) -> None:
    if shutil.which("ssh-add") is None:
        pytest.skip("ssh-add is missing")
    user.up("fwd")
    user.env["SSH_AUTH_SOCK"] = str(agents["key-one"])
    listed = user.ssh("-A", "fwd.devbox", "ssh-add -l")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.decode().split()[2:3] == ["key-one"]
    # Without -A the box sees no agent, as under sshd.
    assert user.ssh("fwd.devbox", "echo [$SSH_AUTH_SOCK]").stdout == b"[]\n"


DEVBOX = f"{sys.executable} -m devbox"
# One line with the agent's keys (by comment) and the socket the shell has.
SHOW = 'echo "keys=[$(ssh-add -l | cut -d" " -f3 | tr "\\n" ,)] sock=$SSH_AUTH_SOCK."'


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_the_persistent_session_follows_the_latest_clients_agent(
    user: User, term: Terminal, agents: dict[str, Path], multiplexer: str
) -> None:
    use_multiplexer(user, multiplexer)
    user.up("keep")
    user.devbox("ssh-config", "--write", check=True)
    ssh = f"ssh -F {user.ssh_config} -A keep.devbox"

    first = term.start(f"SSH_AUTH_SOCK={agents['key-one']} {ssh}")
    term.wait_for(first, PROMPT)
    term.type(first, SHOW)
    shown = term.wait_for(first, "keys=[key-one,]")
    stable = Path(re.findall(r"keys=\[key-one,\] sock=(\S+)\.", shown)[-1])
    folder = os.lstat(stable.parent)
    assert stat.S_ISDIR(folder.st_mode) and stat.S_IMODE(folder.st_mode) == 0o700
    assert folder.st_uid == os.getuid()
    assert len(os.fsencode(stable)) < 100
    term.send(first, "C-a" if multiplexer == "screen" else "C-b", "d")  # detach
    term.wait_for(first, "EXIT=")

    # Another laptop attaches with another agent: the same shell now reaches that one.
    second = term.start(f"SSH_AUTH_SOCK={agents['key-two']} {ssh}")
    term.wait_for(second, PROMPT)
    term.type(second, "clear; " + SHOW)
    term.wait_for(second, f"keys=[key-two,] sock={stable}.")
    term.send(second, "C-a" if multiplexer == "screen" else "C-b", "d")
    term.wait_for(second, "EXIT=")

    # Nobody attached: the stable socket refuses at once (no key, no hang, no SIGPIPE).
    alone = user.ssh("keep.devbox", f"SSH_AUTH_SOCK={stable} ssh-add -l", timeout=20)
    assert alone.returncode == 1 and b"error fetching identities" in alone.stderr, alone
    user.devbox("down", "keep", check=True)
    wait_until(lambda: not stable.parent.exists(), what="the agent socket's folder to go")


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_a_sync_never_lands_in_the_users_own_folder_of_that_name(
    user: User, tmp_path: Path, method: str
) -> None:
    if method == "rsync" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    user.env["DEVBOX_SYNC"] = method
    user.up("sy")
    mine = user.home / "proj"  # the user's own ~/proj: sessions' $HOME is the user's
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    project = tmp_path / "proj"
    project.mkdir()
    (project / "notes.txt").write_text("synced\n")
    user.devbox("sync", "sy", str(project), check=True)
    there = user.box_dir("sy") / "home/proj"
    assert (there / "notes.txt").read_text() == "synced\n"
    ran = user.devbox("run", "--box", "sy", "--sync", str(project), "--", "pwd; cat notes.txt")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.decode().split() == [str(there), "synced"]
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "mine\n"
