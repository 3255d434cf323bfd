"""The commands that drive a box's screen/tmux session address exactly that box's session."""

from __future__ import annotations

import itertools

import pytest

from devbox.boxes import Box, BoxSpec, BoxState, Multiplexer, session_name, session_warning

NAMES = ["dx", "dx-2", "d", "dx2", "1", "12", "a-b", "a", "zq", "zq-2", "x" * 63]


@pytest.mark.parametrize(("a", "b"), list(itertools.permutations(NAMES, 2)))
def test_no_box_session_name_begins_another_boxs(a: str, b: str) -> None:
    # screen's -S NAME picks the first session whose name starts with NAME.
    assert not session_name(b).startswith(session_name(a))


def test_session_names_never_look_like_a_screen_pid() -> None:
    # screen reads "123.name" as pid 123's session "name": a digits-only box is not a pid.
    assert not session_name("123").split(".", 1)[0].isdigit()


def _argvs(mux: Multiplexer, box: str) -> list[list[str]]:
    argvs = [mux.attach_argv(box), mux.quit_argv(box), mux.message_argv(box, "hello")]
    return [argv for argv in argvs if argv is not None]


def test_screen_commands_name_the_exact_session() -> None:
    mux = Multiplexer("screen", "/usr/bin/screen")
    for argv in _argvs(mux, "zq"):
        assert argv[argv.index("-S") + 1] == session_name("zq") == "devbox-zq.box"
    attach = mux.attach_argv("zq")
    assert attach is not None and attach[-2:] == ["-p", "0"]  # the login window


def test_tmux_commands_use_the_boxs_own_server_and_exact_targets() -> None:
    mux = Multiplexer("tmux", "/usr/bin/tmux")
    for argv in _argvs(mux, "zq"):
        assert argv[1:3] == ["-L", session_name("zq")]
        targets = [argv[i + 1] for i, word in enumerate(argv) if word == "-t"]
        assert all(t.startswith("=") for t in targets), argv
    attach = mux.attach_argv("zq")
    assert attach is not None and "=main:=login" in attach


def test_none_has_no_commands() -> None:
    assert _argvs(Multiplexer("none"), "zq") == []


def _box(multiplexer: str | None) -> Box:
    return Box(
        name="bare", owner="u", backend="local", spec=BoxSpec(), state=BoxState.RUNNING,
        multiplexer=multiplexer or "",
    )  # fmt: skip


def test_up_warns_only_of_a_missing_multiplexer_the_user_did_not_choose() -> None:
    said = session_warning(_box("none"), preference="auto")
    assert "box bare" in said and "install screen or tmux" in said
    assert session_warning(_box("none"), preference="screen")
    assert session_warning(_box("none"), preference="none") == ""
    assert session_warning(_box("screen"), preference="auto") == ""
    assert session_warning(_box(None), preference="auto") == ""  # a backend that cannot tell
