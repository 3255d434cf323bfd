"""Where the persistent session's agent socket lives, and what `~` means to SFTP/scp."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.agentfwd import private_folder, stable_path
from agent.sftp import resolve


def test_tilde_and_relative_paths_are_in_home() -> None:
    home = b"/home/u"
    assert resolve(b"~", home) == b"/home/u"
    assert resolve(b"~/r.git", home) == b"/home/u/r.git"
    assert resolve(b"f", home) == b"/home/u/f"
    assert resolve(b".", home) == b"/home/u/."
    assert resolve(b"", home) == b"/home/u"
    assert resolve(b"/etc/hosts", home) == b"/etc/hosts"
    assert resolve(b"~other/x", home) == b"/home/u/~other/x"  # no one else's home


def test_the_stable_path_is_short_and_one_per_box_and_home(tmp_path: Path) -> None:
    one = stable_path(box="b1", home=tmp_path / "a/home")
    assert one == stable_path(box="b1", home=tmp_path / "a/home")
    assert one != stable_path(box="b1", home=tmp_path / "b/home")  # two HOMEs, one uid
    assert one != stable_path(box="b2", home=tmp_path / "a/home")
    long = stable_path(box="x" * 63, home=tmp_path, tmp="/tmp/" + "d" * 90)
    assert len(os.fsencode(long)) < 100


def test_the_folder_is_made_private_and_never_a_link(tmp_path: Path) -> None:
    made = tmp_path / "fresh"
    assert private_folder(made)
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert not private_folder(link)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    assert not private_folder(shared)


def test_a_folder_another_user_planted_at_the_stable_path_is_not_used(
    tmp_path: Path, short_tmp: Path
) -> None:
    # The path is predictable (box name and a hash of its home), so a colleague on the same
    # machine can make it first, 0700 and theirs: the agent must not put the socket there.
    # (The suite runs as root, which can make a folder another uid owns.)
    planted = stable_path(box="b1", home=tmp_path / "home", tmp=str(short_tmp)).parent
    assert planted.parent == short_tmp  # removed with it after the test, never in /tmp
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)  # nobody's
    assert not private_folder(planted)
    assert os.lstat(planted).st_uid == 65534  # left as it was: not taken over, not removed
