"""What `pip install .` puts on a user's machine: every file the program reads at run time
(the tests themselves run from the source tree, which would hide a missing one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_a_non_editable_install_carries_the_runtime_files(tmp_path: Path) -> None:
    # From a copy of the committed files: a build in the work tree reuses its stale build/.
    source, target = tmp_path / "src", tmp_path / "site"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "."],
        cwd=source,
        check=True,
        capture_output=True,
        timeout=300,
    )
    for source in (REPO / "tui").rglob("*.tcss"):
        assert (target / source.relative_to(REPO)).is_file(), f"{source.name} is not installed"
    assert (target / "devbox/cli/__init__.py").is_file() and (target / "agent/main.py").is_file()
