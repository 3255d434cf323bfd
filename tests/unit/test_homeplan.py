"""What a home copy sends, keeps and skips, from two listings (devbox.ssh.homeplan), and
how it reads a listing and names paths (devbox.ssh.homesftp's pure parts)."""

from __future__ import annotations

import stat

import pytest

from devbox.errors import UsageError
from devbox.ssh._asyncssh import asyncssh
from devbox.ssh.homeplan import (
    TEMP_PREFIX,
    Entry,
    Kind,
    below,
    excluded,
    excludes,
    is_temp,
    plan,
    temp_name,
)
from devbox.ssh.homesftp import entry_of, under

FOLDER = Entry(Kind.FOLDER, mode=0o755, mtime=100)


def file(size: int = 3, mtime: int = 100) -> Entry:
    return Entry(Kind.FILE, size=size, mtime=mtime, mode=0o644)


def link(target: str, mtime: int = 100) -> Entry:
    return Entry(Kind.LINK, mtime=mtime, target=target)


def test_an_empty_destination_gets_everything_folders_before_their_contents() -> None:
    src = {
        "a/b": FOLDER,
        "a": FOLDER,
        "a/b/f": file(),
        "a-z": FOLDER,  # sorts between "a" and "a/b" by code point
        "top": file(),
        "l": link("a/b/f"),
    }
    p = plan(src, {})
    assert p.folders == ["a", "a-z", "a/b"]
    assert p.files == ["a/b/f", "top"]
    assert p.links == ["l"]
    assert (p.kept_newer, p.skipped, p.leftovers, p.unchanged) == ([], [], [], 0)


def test_the_quick_check_is_size_and_whole_second_mtime() -> None:
    src = {"same": file(), "resized": file(size=4), "older": file(), "touched": file()}
    dst = {
        "same": file(),
        "resized": file(size=3),  # same time, another size: sent
        "older": file(mtime=99),
        "touched": file(mtime=101),  # newer there: kept, whatever its size
    }
    p = plan(src, dst)
    assert p.files == ["older", "resized"]
    assert p.kept_newer == ["touched"]
    assert p.unchanged == 1


def test_links_compare_by_target_text_and_follow_the_newer_rule() -> None:
    src = {"same": link("x"), "moved": link("y"), "theirs": link("z"), "was_file": link("x")}
    dst = {
        "same": link("x", mtime=1),  # same text: nothing to do, whatever the times
        "moved": link("old"),
        "theirs": link("mine", mtime=500),
        "was_file": file(mtime=50),
    }
    p = plan(src, dst)
    assert p.links == ["moved", "was_file"]
    assert p.kept_newer == ["theirs"]
    assert p.unchanged == 1


def test_a_link_on_the_destination_is_replaced_or_kept_never_descended() -> None:
    src = {"f": file(), "g": file(), "dir": FOLDER, "dir/inside": file()}
    dst = {
        "f": link("/etc/passwd", mtime=50),  # older: the rename replaces the link itself
        "g": link("/etc/passwd", mtime=500),  # newer: kept
        "dir": link("/elsewhere"),
    }
    p = plan(src, dst)
    assert p.files == ["f"]
    assert p.kept_newer == ["g"]
    assert p.skipped == ["dir (the destination has a symlink there)"]
    assert p.folders == []  # nothing under dir/ is made or sent


def test_nothing_takes_the_place_of_a_folder_and_no_folder_of_a_file() -> None:
    src = {"was_dir": file(), "was_file": FOLDER, "was_file/x": file()}
    dst = {"was_dir": FOLDER, "was_file": file(mtime=1)}
    p = plan(src, dst)
    assert p.files == []
    assert p.skipped == [
        "was_dir (the destination has a folder there)",
        "was_file (the destination has a file there)",
    ]


def test_special_files_and_unlisted_folders_are_skipped_with_a_reason() -> None:
    src = {
        "pipe": Entry(Kind.FIFO),
        "sock": Entry(Kind.SOCKET),
        "tty": Entry(Kind.DEVICE),
        "locked": Entry(Kind.FOLDER, error="Permission denied"),
        "locked/x": file(),
        "shut": FOLDER,
        "shut/y": file(),
    }
    dst = {"shut": Entry(Kind.FOLDER, error="Permission denied")}
    p = plan(src, dst)
    assert p.skipped == [
        "locked (cannot list it: Permission denied)",
        "pipe (a fifo)",
        "shut (cannot list it on the destination: Permission denied)",
        "sock (a socket)",
        "tty (a device)",
    ]
    assert p.files == [] and p.folders == []


def test_partial_files_of_an_interrupted_copy_are_never_copied_and_are_cleaned_up() -> None:
    left = temp_name()
    src = {f"a/{left}": file(), "a": FOLDER}
    dst = {
        "a": FOLDER,
        f"a/{left}": file(),
        left: link("x"),
        f"{TEMP_PREFIX}notours": file(),  # not the pattern: the user's
        "keep": file(),
    }
    p = plan(src, dst)
    assert p.files == []
    assert p.skipped == [f"a/{left} (a partial file of an interrupted copy)"]
    assert p.leftovers == sorted([f"a/{left}", left])


def test_temporary_names_are_fresh_and_recognised() -> None:
    names = {temp_name() for _ in range(50)}
    assert len(names) == 50
    assert all(is_temp(f"some/where/{n}") for n in names)
    assert not is_temp("file") and not is_temp(f"{TEMP_PREFIX}x")


@pytest.mark.parametrize(
    ("given", "normal"),
    [("a/b", "a/b"), ("./a/b/", "a/b"), ("a//b", "a/b"), (".cache", ".cache")],
)
def test_excludes_are_normalised(given: str, normal: str) -> None:
    assert excludes([given]) == {normal}


@pytest.mark.parametrize("bad", ["/etc", "..", "../x", ".", ""])
def test_an_exclude_outside_the_root_is_bad_input(bad: str) -> None:
    with pytest.raises(UsageError, match="relative to the home"):
        excludes([bad])


def test_an_excluded_folder_takes_its_subtree_and_nothing_more() -> None:
    skip = excludes(["data/raw", ".cache"])
    assert excluded("data/raw", skip)
    assert excluded("data/raw/x/y", skip)
    assert excluded(".cache/pip", skip)
    assert not excluded("data", skip)
    assert not excluded("data/raw2", skip)
    assert not excluded("data/rawx/y", skip)


def test_below_means_strictly_inside() -> None:
    assert below("a/b/c", {"a"})
    assert not below("a", {"a"})
    assert not below("ab/c", {"a"})


@pytest.mark.parametrize(
    ("root", "rel", "path"),
    [("", "", "."), ("", "a/b", "a/b"), ("src", "", "src"), ("src", "a", "src/a"),
     ("/abs", "a", "/abs/a"), ("/", "a", "/a")],
)  # fmt: skip
def test_paths_under_a_root(root: str, rel: str, path: str) -> None:
    assert under(root, rel) == path


def test_a_listing_entry_says_the_kind_and_keeps_only_permission_bits() -> None:
    def of(mode: int) -> Entry:
        return entry_of(asyncssh.SFTPAttrs(permissions=mode, size=7, mtime=123))

    assert of(stat.S_IFREG | stat.S_ISUID | 0o4755) == Entry(Kind.FILE, 7, 123, 0o755)
    assert of(stat.S_IFDIR | stat.S_ISVTX | 0o1777).mode == 0o777
    assert of(stat.S_IFLNK | 0o777).kind is Kind.LINK
    assert of(stat.S_IFIFO | 0o600).kind is Kind.FIFO
    assert of(stat.S_IFSOCK | 0o600).kind is Kind.SOCKET
    assert of(stat.S_IFCHR | 0o600).kind is Kind.DEVICE
    assert of(stat.S_IFBLK | 0o600).kind is Kind.DEVICE
    assert entry_of(asyncssh.SFTPAttrs()).kind is Kind.OTHER  # a server that says nothing
