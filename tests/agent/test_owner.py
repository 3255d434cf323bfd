"""agent/owner.py as root, in a child process (it changes the process's uid for good):
the owner's home is theirs and private, and a home or uid of someone else is refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent import owner
from devbox.protocol import home_folder


def _in_child(test: object) -> tuple[int, str]:
    """Runs `test()` in a forked child; returns its exit status and what it wrote."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(read)
        try:
            out = str(test())  # type: ignore[operator]
            code = 0
        except owner.OwnerError as exc:
            out, code = f"OwnerError: {exc}", 3
        except BaseException as exc:
            out, code = f"{type(exc).__name__}: {exc}", 4
        os.write(write, out.encode())
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("these tests make homes for other uids: run them as root (CI does)")
    root = tmp_path / "homes"
    root.mkdir(mode=0o755)
    (tmp_path / "etc").mkdir()
    return root


def _become(volume: Path, name: str) -> tuple[int, str]:
    def run() -> str:
        home = owner.become(name, "login", volume, accounts=volume.parent / "etc")
        return f"{os.getuid()} {os.getgid()} {os.getgroups()} {home}"

    return _in_child(run)


def test_the_owner_gets_a_private_home_and_becomes_its_uid(volume: Path) -> None:
    code, out = _become(volume, "alice@lab")
    assert code == 0, out
    uid = owner.owner_uid("alice@lab")
    assert out == f"{uid} {uid} [] {volume / home_folder('alice@lab')}"
    info = os.lstat(volume / home_folder("alice@lab"))
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (uid, uid, 0o700)
    assert stat.S_IMODE(os.lstat(volume).st_mode) == 0o711  # nobody lists the others
    passwd = (volume.parent / "etc/passwd").read_text()
    assert passwd == f"login:x:{uid}:{uid}::{volume / home_folder('alice@lab')}:/bin/bash\n"
    # Again (a second box): the same home, the same uid.
    assert _become(volume, "alice@lab") == (code, out)


def test_a_uid_that_stands_for_someone_else_is_refused(volume: Path) -> None:
    uid = owner.owner_uid("bob")
    (volume / owner.REGISTRY).mkdir(mode=0o700)
    (volume / owner.REGISTRY / str(uid)).write_text("mallory")  # a hash collision
    code, out = _become(volume, "bob")
    assert code == 3 and "already stands for another user" in out, out
    assert not (volume / home_folder("bob")).exists()


def test_a_planted_or_foreign_home_is_refused(volume: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (volume / home_folder("carol")).symlink_to(target)
    code, out = _become(volume, "carol")
    assert code == 3 and "is not a folder" in out, out
    assert os.lstat(target).st_uid == 0  # not handed to carol through the link
    (volume / home_folder("dave")).mkdir()
    os.chown(volume / home_folder("dave"), 4242, 4242)
    code, out = _become(volume, "dave")
    assert code == 3 and "belongs to uid 4242" in out, out


def test_uids_are_stable_and_apart() -> None:
    names = ["alice", "jürgen", "jörgen", "王伟", "x" * 200]
    uids = [owner.owner_uid(n) for n in names]
    assert len(set(uids)) == len(names)
    assert all(owner.UID_BASE <= u < owner.UID_BASE + owner.UID_SPAN for u in uids)
    assert uids == [owner.owner_uid(n) for n in names]


def test_a_name_cannot_write_an_account_line_of_its_own(volume: Path) -> None:
    name = "eve\nroot2:x:0:0::/:/bin/bash"
    code, out = _become(volume, name)
    assert code == 0, out
    lines = (volume.parent / "etc/passwd").read_text().splitlines()
    uid = owner.owner_uid(name)
    assert lines == [f"login:x:{uid}:{uid}::/:/bin/bash"]
