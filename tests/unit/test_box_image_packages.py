"""The box image's OS packages (images/box/setup.sh's system step) hold what editors'
remote-server installers (VS Code, Cursor, JetBrains Gateway) and git need."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

SETUP = REPO / "images/box/setup.sh"
NEEDED = {"curl", "wget", "git", "ca-certificates", "openssh-client", "tar", "gzip", "procps"}


def packages() -> list[str]:
    # The step installs `$PACKAGES`, one word a package: read it as sh would.
    shown = subprocess.run(
        ["sh", "-c", f'eval "$(sed -n \'/^PACKAGES="/,/"$/p\' {SETUP})"; echo $PACKAGES'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shown.split()


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_the_system_step_installs_what_editors_and_git_need() -> None:
    assert re.search(r"apt-get install .*\$missing", SETUP.read_text())
    listed = packages()
    assert set(listed) >= NEEDED, NEEDED - set(listed)
    assert len(listed) == len(set(listed))


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="no apt here")
def test_every_package_is_one_debian_knows() -> None:
    known = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", *packages()], capture_output=True, text=True
    )
    if "No packages found" in known.stderr and not known.stdout:
        pytest.skip("this machine's apt has no package lists")
    names = set(re.findall(r"^Package: (\S+)$", known.stdout, flags=re.MULTILINE))
    assert set(packages()) <= names, set(packages()) - names
