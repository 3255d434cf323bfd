"""agent/owner.py as root with a box pod's capabilities, in a process of its own (it
changes its uid for good): the owner's home is theirs and private, and a home or uid of
someone else is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent import owner
from devbox.backends.kubernetes.pods import AGENT_CAPABILITIES
from devbox.protocol import home_folder
from tests.conftest import REPO

# As in a box pod: root with only the capabilities the pod spec adds.
CAPS = ",".join(f"+{c.lower()}" for c in AGENT_CAPABILITIES)
CHILD = """
import os, sys
from pathlib import Path
from agent import owner
volume, name = Path(sys.argv[1]), sys.argv[2]
try:
    home = owner.become(name, "login", volume, accounts=volume.parent / "etc")
except owner.OwnerError as exc:
    print(f"OwnerError: {exc}")
    sys.exit(3)
print(os.getuid(), os.getgid(), os.getgroups(), home)
"""


def _become(volume: Path, name: str) -> tuple[int, str]:
    """become() in a process of its own (it changes its uid for good), with the pod's
    capabilities only: no DAC override, so the owner's 0700 folder is closed to it."""
    done = subprocess.run(
        ["setpriv", f"--bounding-set=-all,{CAPS}", "--inh-caps=-all",
         sys.executable, "-c", CHILD, str(volume), name],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout.strip()


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("these tests make homes for other uids: run them as root (CI does)")
    root = tmp_path / "homes"
    root.mkdir(mode=0o755)
    (tmp_path / "etc").mkdir()
    return root


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
