"""The pure parts of `devbox run`: a record's state, .gitignore matching (against git itself),
and shell completion (driven through a real bash)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devbox import offers
from devbox.cli import completion
from devbox.runs import ignore, record

REPO = Path(__file__).resolve().parents[2]


def _run(**changes: object) -> record.Run:
    base: dict[str, object] = {
        "id": "ab12",
        "box": "b",
        "command": "true",
        "cwd": "/",
        "created_at": 1000.0,
    }
    return record.Run(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "alive", "killed", "now", "state"),
    [
        ({}, False, False, 1001.0, record.STARTING),
        ({}, False, False, 1000.0 + record.START_GRACE_SECONDS + 1, record.LOST),
        ({"started_at": 1001.0}, True, False, 5000.0, record.RUNNING),
        ({"started_at": 1001.0}, False, False, 1002.0, record.LOST),
        ({"started_at": 1.0, "ended_at": 2.0, "exit_code": 0}, False, False, 3.0, record.DONE),
        ({"started_at": 1.0, "ended_at": 2.0, "exit_code": 2}, False, False, 3.0, record.FAILED),
        ({"started_at": 1.0, "ended_at": 2.0, "signal": "SEGV"}, False, False, 3.0, record.FAILED),
        ({"started_at": 1.0, "ended_at": 2.0, "signal": "TERM"}, False, True, 3.0, record.KILLED),
    ],
)
def test_state_of(
    changes: dict[str, object], alive: bool, killed: bool, now: float, state: str
) -> None:
    assert record.state_of(_run(**changes), alive=alive, killed=killed, now=now) == state


def test_outcome_and_status_code_read_like_a_shell() -> None:
    assert _run(exit_code=3).outcome() == "exit 3" and _run(exit_code=3).status_code() == 3
    assert _run(signal="TERM").outcome() == "SIGTERM" and _run(signal="TERM").status_code() == 143
    assert _run().outcome() == "-"


def test_records_round_trip_and_running_is_the_held_lock(tmp_path: Path) -> None:
    run = _run(id="k7mq", started_at=1001.0, pid=42)
    (tmp_path / "k7mq").mkdir()
    (tmp_path / "active").mkdir()
    (tmp_path / "active/k7mq").touch()
    record.write(tmp_path, run)
    assert record.read(tmp_path, "k7mq").state == record.LOST  # no wrapper holds the lock
    assert record.count_running(tmp_path) == 0
    fd = os.open(tmp_path / "k7mq/lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Another open file description, as another process would have.
        assert record.read(tmp_path, "k7mq").state == record.RUNNING
        assert record.count_running(tmp_path) == 1
    finally:
        os.close(fd)
    assert record.read(tmp_path, "k7mq") == record.Run(**{**run.to_json(), "state": "lost"})
    assert [r.id for r in record.read_all(tmp_path)] == ["k7mq"]
    with pytest.raises(FileNotFoundError):
        record.read(tmp_path, "none")
    assert record.valid_id(record.new_id()) and not record.valid_id("../x")


GITIGNORE_CASES = {
    ".gitignore": "*.log\n!keep.log\nbuild/\n/top.txt\ndocs/**/draft*\n\\#hash\nsp?ce\n",
    "sub/.gitignore": "*.tmp\n/only-here\nnested/deep/\n",
}
FILES = [
    "a.py", "x.log", "keep.log", "top.txt", "sub/top.txt", "build/out.o", "sub/build/o",
    "docs/draft1.md", "docs/a/b/draft2.md", "docs/final.md", "#hash", "space", "spice.txt",
    "sub/x.tmp", "sub/only-here", "sub/more/only-here", "sub/nested/deep/f", "nested/deep/g",
    "build.txt", "sub/keep.log",
]  # fmt: skip


def test_gitignore_matching_agrees_with_git(tmp_path: Path) -> None:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    for rel, text in GITIGNORE_CASES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for rel in FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    subprocess.run([git, "init", "-q", str(tmp_path)], check=True)
    listed = subprocess.run(
        [git, "-C", str(tmp_path), "ls-files", "--others", "--cached", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ours = list(ignore.walk(tmp_path))
    assert sorted(ours) == sorted(listed)
    assert "keep.log" in ours and "x.log" not in ours  # the case a naive filter gets wrong


def _bash_complete(env: dict[str, str], line: str) -> list[str]:
    words = line.split(" ")
    script = completion.script(
        "bash", commands=["up", "run", "logs", "ssh"], devbox=f"{sys.executable} -m devbox"
    )
    program = (
        f"{script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words) - 1}; _devbox; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    done = subprocess.run(
        ["bash", "-c", program], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.split()


def test_bash_completion_names_boxes_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for box in ("alpha", "beta"):
        (tmp_path / f".local/state/devbox/local/boxes/{box}").mkdir(parents=True)
        (tmp_path / f".local/state/devbox/local/boxes/{box}/box.json").write_text("{}")
    # A box folder without a record (a released box's kept home) is no box to offer.
    (tmp_path / ".local/state/devbox/local/boxes/gone").mkdir()
    offers.remember_runs("alpha", ["k7mq", "p2zz"])
    offers.remember_runs("alpha", ["q3rs"])
    assert _bash_complete(env, "devbox ") == ["up", "run", "logs", "ssh"]
    assert _bash_complete(env, "devbox r") == ["run"]
    assert _bash_complete(env, "devbox ssh ") == ["alpha", "beta"]
    assert _bash_complete(env, "devbox run --box b") == ["beta"]
    assert _bash_complete(env, "devbox logs alpha ") == ["q3rs", "p2zz", "k7mq"]
    assert _bash_complete(env, "devbox logs --backend local alpha k") == ["k7mq"]
    assert _bash_complete(env, "devbox logs beta ") == []
    assert _bash_complete(env, "devbox run --box alpha -- ") == []


def test_completion_scripts_are_valid_shell() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "devbox", "completion", "bash"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert "complete -o default -F _devbox devbox" in done.stdout
    assert " run " in done.stdout and " completion" in done.stdout
    subprocess.run(["bash", "-n"], input=done.stdout, text=True, check=True)
    zsh = shutil.which("zsh")
    script = completion.script("zsh", commands=["up"])
    if zsh is not None:
        subprocess.run([zsh, "-n"], input=script, text=True, check=True)
    assert script.startswith("#compdef devbox")
