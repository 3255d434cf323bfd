"""Persistent sessions through a real terminal: screen or tmux in the box, a dropped client
loses nothing, and a window-size change reaches the program."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import PROMPT, User
from tests.terminal import Terminal


def _use(user: User, multiplexer: str) -> None:
    config = user.home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'multiplexer = "{multiplexer}"\n')


DEVBOX = f"{sys.executable} -m devbox"


@pytest.mark.parametrize("multiplexer", ["screen", "tmux"])
def test_session_survives_a_killed_client(
    user: User, term: Terminal, multiplexer: str, ssh_client: str
) -> None:
    if shutil.which(multiplexer) is None:
        pytest.skip(f"{multiplexer} is not installed")
    _use(user, multiplexer)
    first = term.start(f"{DEVBOX} up keep")  # a TTY: `up` attaches the session
    term.wait_for(first, PROMPT)
    term.type(first, "export MARK=kept-$((6*7)); cd /tmp")
    term.type(first, "echo ready-$MARK")
    term.wait_for(first, "ready-kept-42")
    term.kill_window(first)  # the client dies without detaching

    again = term.start(f"{DEVBOX} ssh keep")
    term.wait_for(again, PROMPT)
    term.type(again, "echo back-$MARK-$(pwd)")
    term.wait_for(again, "back-kept-42-/tmp")
    box_box = user.devbox("ssh", "keep", "--", "echo $DEVBOX_BOX", check=True)
    assert box_box.stdout == b"keep\n"


def test_window_size_changes_reach_the_box(user: User, term: Terminal, ssh_client: str) -> None:
    _use(user, "screen" if shutil.which("screen") else "tmux")
    user.up("sized")
    target = term.start(f"{DEVBOX} ssh sized")
    term.wait_for(target, PROMPT)
    term.type(target, "stty size")
    term.wait_for(target, "40 120")
    term.resize(target, 90, 25)
    term.type(target, "stty size")
    term.wait_for(target, "25 90")


def test_without_a_multiplexer_a_plain_shell_with_a_warning(
    user: User, term: Terminal, tmp_path: Path
) -> None:
    empty = tmp_path / "bin-without-screen-or-tmux"
    empty.mkdir()
    user.env["PATH"] = str(empty)  # the agent inherits it and finds neither
    user.up("plain")
    target = term.start(f"{DEVBOX} ssh plain")
    term.wait_for(target, "warning: neither screen nor tmux is installed")
    term.type(target, "echo plain-$DEVBOX_BOX; exit 5")
    term.wait_for(target, "EXIT=5")
    assert "plain-plain" in term.screen(target)


def test_multiplexer_none_is_a_plain_shell_without_warning(user: User, term: Terminal) -> None:
    _use(user, "none")
    user.up("chosen")
    target = term.start(f"{DEVBOX} ssh chosen")
    term.wait_for(target, PROMPT)
    term.type(target, "exit 4")
    shown = term.wait_for(target, "EXIT=4")
    assert "warning" not in shown


def test_down_ends_the_session(user: User, term: Terminal) -> None:
    if shutil.which("screen") is None:
        pytest.skip("screen is not installed")
    _use(user, "screen")
    target = term.start(f"{DEVBOX} up gone")
    term.wait_for(target, PROMPT)
    term.type(target, "sleep 300")
    user.devbox("down", "gone", check=True)
    term.wait_for(target, "EXIT=")
    listing = (
        shutil.which("screen")
        and __import__("subprocess")
        .run(["screen", "-ls"], env=user.env, capture_output=True, text=True)
        .stdout
    )
    assert "devbox-gone" not in str(listing)
