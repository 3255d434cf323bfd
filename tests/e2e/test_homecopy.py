"""`devbox move`'s copy of a home, box to box through this process: two real local boxes,
their agents' real SFTP servers, devbox's own client. A local box's sessions start in the
user's $HOME, which both boxes share, so each test copies one folder of it into another.
Only what changed travels, and nothing on the destination is lost."""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from devbox import connect
from devbox.backends.base import Backend
from devbox.boxes import Box
from devbox.errors import DevboxError
from devbox.ssh import homecopy, homesftp
from devbox.ssh.homeplan import TEMP_PREFIX
from tests.conftest import User
from tests.e2e.helpers import start_devbox

T = 1_700_000_000  # a fixed past time, so mtimes say what the copy set, not when it ran
MIB = 1 << 20


@dataclass
class Boxes:
    """Boxes "old" and "new" of one user, and this process connecting as that user."""

    user: User
    backend: Backend
    old: Box
    new: Box

    @property
    def src(self) -> Path:
        return self.user.home / "src"

    @property
    def dst(self) -> Path:
        return self.user.home / "dst"

    def sockets(self) -> tuple[socket.socket, socket.socket]:
        old = connect.open_socket(self.backend, self.old)
        return old, connect.open_socket(self.backend, self.new)

    def copy(
        self, *, exclude: tuple[str, ...] = (), progress: Callable[[str], None] | None = None
    ) -> tuple[homecopy.Copied, list[str]]:
        lines: list[str] = []

        def say(line: str) -> None:
            lines.append(line)
            if progress:
                progress(line)

        old, new = self.sockets()
        copied = homecopy.copy_home(
            self.old, old, self.new, new, src_root="src", dst_root="dst", exclude=exclude,
            progress=say,
        )  # fmt: skip
        return copied, lines


@pytest.fixture
def boxes(user: User, monkeypatch: pytest.MonkeyPatch) -> Boxes:
    for key, value in user.env.items():
        monkeypatch.setenv(key, value)
    ups = [start_devbox(user, "up", name, "--no-attach", "--json") for name in ("old", "new")]
    for up in ups:
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0, err.decode()
    backend = connect.backend_for(argparse.Namespace())
    (user.home / "src").mkdir()
    return Boxes(user, backend, backend.get("old"), backend.get("new"))


def write(path: Path, data: bytes, *, mode: int = 0o644, mtime: int = T) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    os.utime(path, (mtime, mtime))
    return path


def write_all(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        write(root / rel, data)


def symlink(path: Path, target: str, *, mtime: int = T) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    os.utime(path, (mtime, mtime), follow_symlinks=False)


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """What a copy must carry, by relative path: kind, mode, mtime, and the data's hash or a
    link's target. Links are never followed."""
    found: dict[str, tuple[object, ...]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path), int(st.st_mtime))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("folder", stat.S_IMODE(st.st_mode), int(st.st_mtime))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[rel] = ("file", stat.S_IMODE(st.st_mode), int(st.st_mtime), digest)
    return found


def regular_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if stat.S_ISREG(p.lstat().st_mode)]


def summary(lines: list[str]) -> str:
    return next(line for line in lines if "sending" in line)


def partial_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def test_a_tree_arrives_intact_then_only_what_changed_travels(boxes: Boxes) -> None:
    src = boxes.src
    big = os.urandom(5 * MIB + 123)  # a few chunks and a short last one
    write(src / "big.bin", big)
    write(src / "run.sh", b"#!/bin/sh\necho hi\n", mode=0o755)
    write(src / "a/b/c/deep.txt", b"deep\n")
    write(src / "readonly.txt", b"ro\n", mode=0o444)
    write(src / "private/key", b"secret\n", mode=0o600)
    write(src / "frozen/inside.txt", b"in a read-only folder\n")
    write(src / "empty.txt", b"")
    write(src / os.fsdecode(b"latin-1 caf\xe9.txt"), b"a name that is not UTF-8\n")
    (src / "empty").mkdir()
    symlink(src / "to-deep", "a/b/c/deep.txt")
    symlink(src / "outside", "/etc/hostname")  # outside the tree, never followed
    symlink(src / "a/up", "../../elsewhere")  # relative, out of the tree, dangling
    for folder, mode in (("private", 0o700), ("frozen", 0o555)):
        (src / folder).chmod(mode)
    # Folders last, deepest first: writing into one changes its time.
    for folder in ("a/b/c", "a/b", "a", "private", "frozen", "empty"):
        os.utime(src / folder, (T + 1, T + 1))

    copied, lines = boxes.copy()
    assert tree(boxes.dst) == tree(src)
    files_and_links = sorted(rel for rel, what in tree(src).items() if what[0] != "folder")
    assert copied.sent == files_and_links
    assert copied.sent_bytes == sum(p.lstat().st_size for p in regular_files(src))
    assert copied.folders == 7  # dst itself, a, a/b, a/b/c, private, frozen, empty
    assert copied.kept_newer == [] and copied.skipped == []
    assert len(lines) < len(files_and_links)  # now and then, not one a file
    assert "sending 8 files (5.0 MiB) and 3 links, making 6 folders; 0 unchanged" in summary(lines)
    assert partial_files(boxes.dst) == []

    again, lines = boxes.copy()
    assert (again.sent, again.sent_bytes, again.folders) == ([], 0, 0)
    assert again.kept_newer == [] and again.skipped == []
    assert "sending 0 files (0 B) and 0 links, making 0 folders; 11 unchanged" in summary(lines)

    # Same size, new data, a later time: whole-second mtimes tell it changed.
    write(src / "a/b/c/deep.txt", b"DEEP\n", mtime=T + 60)
    third, _ = boxes.copy()
    assert third.sent == ["a/b/c/deep.txt"] and third.sent_bytes == 5
    assert (boxes.dst / "a/b/c/deep.txt").read_bytes() == b"DEEP\n"
    assert tree(boxes.dst) == tree(src)


def test_work_on_the_destination_is_never_lost(boxes: Boxes) -> None:
    src, dst, home = boxes.src, boxes.dst, boxes.user.home
    write_all(src, {
        "notes.txt": b"written on the old box\n",
        "plain.txt": b"plain\n",
        "planted-new": b"the source's file\n",
        "planted-old": b"the source's file\n",
        "dir-is-link/inside.txt": b"must not land outside\n",
        "was-a-folder": b"a file on the source\n",
        "sub/more.txt": b"more\n",
    })  # fmt: skip

    write(dst / "notes.txt", b"edited on the new box since\n", mtime=T + 100)
    write(dst / "only-here.txt", b"made on the new box\n")
    outside = write(home / "outside.txt", b"precious\n")
    outside_dir = home / "outside-dir"
    outside_dir.mkdir()
    # Links planted where the source has a file, both pointing out of the destination's
    # tree: one newer than the source's file (kept), one older (replaced by the file).
    symlink(dst / "planted-new", str(outside), mtime=T + 100)
    symlink(dst / "planted-old", str(outside), mtime=T - 100)
    symlink(dst / "dir-is-link", str(outside_dir))  # where the source has a folder
    (dst / "was-a-folder").mkdir()
    write(dst / "was-a-folder/theirs.txt", b"theirs\n")
    leftover = write(dst / "sub" / f"{TEMP_PREFIX}0123456789abcdef", b"half a fi")

    copied, _ = boxes.copy()
    assert copied.sent == ["plain.txt", "planted-old", "sub/more.txt"]
    assert copied.kept_newer == ["notes.txt", "planted-new"]
    assert copied.skipped == [
        "dir-is-link (the destination has a symlink there)",
        "was-a-folder (the destination has a folder there)",
    ]
    assert (dst / "notes.txt").read_bytes() == b"edited on the new box since\n"
    assert (dst / "only-here.txt").read_bytes() == b"made on the new box\n"
    assert (dst / "was-a-folder/theirs.txt").read_bytes() == b"theirs\n"
    assert os.readlink(dst / "planted-new") == str(outside)
    # The link itself was replaced: the file is where the link was, not where it pointed.
    assert not (dst / "planted-old").is_symlink()
    assert (dst / "planted-old").read_bytes() == b"the source's file\n"
    assert outside.read_bytes() == b"precious\n"
    assert list(outside_dir.iterdir()) == []
    assert not leftover.exists()  # an interrupted copy's debris: gone, not copied back
    assert partial_files(dst) == []


def test_special_vanished_and_excluded_files_stay_behind(boxes: Boxes) -> None:
    src, dst = boxes.src, boxes.dst
    write_all(src, {
        "keep.txt": b"keep\n",
        ".cache/pip/wheel.whl": b"cached\n",
        "data/raw/shard0": b"huge\n",
        "data/raw2/shard0": b"not excluded: another name\n",
        "data/clean.csv": b"a,b\n",
        "gone.txt": b"deleted while the copy runs\n",
        "turned.txt": b"a folder by the time it is read: unreadable, even for root\n",
    })  # fmt: skip
    os.mkfifo(src / "pipe")

    def change_after_listing(line: str) -> None:
        if "sending" in line:  # the plan is made: the files are listed, not yet read
            (src / "gone.txt").unlink()
            (src / "turned.txt").unlink()
            (src / "turned.txt").mkdir()

    copied, _ = boxes.copy(exclude=(".cache", "./data/raw/"), progress=change_after_listing)
    assert copied.sent == ["data/clean.csv", "data/raw2/shard0", "keep.txt"]
    assert copied.sent_bytes == len(b"a,b\nnot excluded: another name\nkeep\n")
    assert len(copied.skipped) == 3, copied.skipped
    gone, pipe, turned = copied.skipped
    assert pipe == "pipe (a fifo)"
    assert gone.startswith("gone.txt (box old: cannot read it: ")
    assert turned.startswith("turned.txt (box old: cannot read it: ")
    assert sorted(p.name for p in dst.iterdir()) == ["data", "keep.txt"]
    assert sorted(p.name for p in (dst / "data").iterdir()) == ["clean.csv", "raw2"]
    assert partial_files(dst) == []


@pytest.mark.parametrize("dies", ["old", "new"])
def test_a_lost_box_is_one_line_and_leaves_no_half_file(
    boxes: Boxes, dies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(8 * MIB)
    write(boxes.src / "model.ckpt", data)
    write(boxes.dst / "model.ckpt", b"the last good checkpoint\n", mtime=T - 100)
    monkeypatch.setattr(homecopy, "PROGRESS_SECONDS", 0.0)  # a line after every chunk
    old, new = boxes.sockets()
    victim = old if dies == "old" else new
    cuts: list[str] = []

    def cut(line: str) -> None:
        if line.startswith("sent ") and not cuts:  # the first chunk is in the temporary file
            cuts.append(line)
            victim.shutdown(socket.SHUT_RDWR)

    with pytest.raises(DevboxError) as failed:
        homecopy.copy_home(
            boxes.old, old, boxes.new, new, src_root="src", dst_root="dst", progress=cut
        )
    assert failed.value.message.startswith(f"lost the connection to box {dies}: ")
    assert "\n" not in failed.value.message
    # The real name still holds what it held: the data went to a temporary name, which
    # the copy removed where the destination was still there to hear it.
    assert (boxes.dst / "model.ckpt").read_bytes() == b"the last good checkpoint\n"
    left = partial_files(boxes.dst)
    if dies == "new":
        assert len(left) == 1 and left[0].stat().st_size == homesftp.CHUNK
    else:
        assert left == []

    copied, _ = boxes.copy()
    assert copied.sent == ["model.ckpt"]
    assert (boxes.dst / "model.ckpt").read_bytes() == data
    assert partial_files(boxes.dst) == []
