"""Bad input: one line `devbox: error: ...`, the right exit status, other boxes untouched."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import User


def _one_line_error(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    assert err.startswith("devbox: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def bystander(user: User) -> Iterator[User]:
    """A box that every bad command must leave running and reachable."""
    user.up("bystander")
    yield user
    assert user.devbox("ssh", "bystander", "--", "echo", "fine").stdout == b"fine\n"
    boxes = {b["name"]: b for b in json.loads(user.devbox("ls", "--json").stdout)}
    assert boxes["bystander"]["state"] == "running"


@pytest.mark.parametrize("name", ["Upper", "under_score", "-lead", "trail-", "a" * 64, "", "a.b"])
@pytest.mark.parametrize("command", ["up", "ssh", "down", "proxy"])
def test_invalid_names(bystander: User, command: str, name: str) -> None:
    args = [command, name, "--no-attach"] if command == "up" else [command, name]
    err = _one_line_error(bystander.devbox(*args), 2)
    if not name.startswith("-"):  # argparse reads "-lead" as an unknown flag: still one line
        assert "box name" in err


def test_name_already_in_use(bystander: User) -> None:
    err = _one_line_error(bystander.devbox("up", "bystander", "--no-attach"), 2)
    assert "already exists" in err


@pytest.mark.parametrize("command", ["ssh", "down", "proxy"])
def test_unknown_box(bystander: User, command: str) -> None:
    err = _one_line_error(bystander.devbox(command, "nosuchbox"), 2)
    assert "no box named 'nosuchbox'" in err


@pytest.mark.parametrize("gpus", ["-1", "two", "1.5", ""])
def test_bad_gpu_count(bystander: User, gpus: str) -> None:
    err = _one_line_error(bystander.devbox("up", "g", "--gpus", gpus, "--no-attach"), 2)
    assert "GPU count" in err


def test_port_already_taken(bystander: User) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _one_line_error(
            bystander.devbox("up", "porty", "--port", str(port), "--no-attach"), 2
        )
    assert f"port 127.0.0.1:{port} is already in use" in err
    assert "porty" not in bystander.devbox("ls").stdout.decode()
    # The name is free again: the failed claim left nothing behind.
    assert bystander.devbox("up", "porty", "--no-attach").returncode == 0


def test_corrupted_box_state(bystander: User) -> None:
    bystander.up("broken")
    record = bystander.box_dir("broken") / "box.json"
    record.write_text('{"name": "broken", "own')
    listing = bystander.devbox("ls")
    assert listing.returncode == 1
    assert "bystander" in listing.stdout.decode()
    err = listing.stderr.decode()
    assert (
        err == f"devbox: error: state file {record} is corrupted (JSONDecodeError); "
        "`devbox down` it or fix the file\n"
    )
    _one_line_error(bystander.devbox("ssh", "broken", "--", "true"), 1)
    # down still stops it (its agent is found through its lock file) and keeps the home.
    assert bystander.devbox("down", "broken").returncode == 0
    assert bystander.devbox("ls").returncode == 0
    assert (bystander.box_dir("broken") / "home").is_dir()


def test_unreadable_box_state(bystander: User) -> None:
    bystander.up("hidden")
    record = bystander.box_dir("hidden") / "box.json"
    saved = record.read_text()
    # Unreadable even for root (the tests run as root in CI): a folder where the file was.
    record.unlink()
    record.mkdir()
    err = _one_line_error(bystander.devbox("ls"), 1)
    assert err == f"devbox: error: cannot read state file {record}: Is a directory\n"
    record.rmdir()
    record.write_text(saved)
    assert bystander.devbox("ssh", "hidden", "--", "echo", "ok").stdout == b"ok\n"


@pytest.mark.parametrize(
    "content,needle",
    [
        ("backend = \n", "not valid TOML"),
        ('backend = "moon"\n', "backend must be one of"),
        ('colour = "blue"\n', "unknown setting 'colour'"),
        ("start_timeout = -3\n", "start_timeout must be"),
        ('multiplexer = "byobu"\n', "multiplexer must be one of"),
        (b"\xff\xfe".decode("latin-1"), "not valid TOML"),
    ],
)
def test_bad_config_file(bystander: User, content: str, needle: str) -> None:
    config = bystander.home / ".config/devbox/config.toml"
    config.write_text(content, encoding="latin-1")
    try:
        for args in (["ls"], ["up", "x", "--no-attach"], ["ssh", "bystander", "--", "true"]):
            assert needle in _one_line_error(bystander.devbox(*args), 2)
    finally:
        config.unlink()


def test_unknown_command_and_flag(user: User) -> None:
    _one_line_error(user.devbox("teleport"), 2)
    _one_line_error(user.devbox("ls", "--colour"), 2)


def test_debug_shows_the_traceback(user: User) -> None:
    result = user.devbox("--debug", "ssh", "nosuchbox")
    assert result.returncode == 1 and b"Traceback" in result.stderr


def test_ssh_config_that_cannot_be_written_is_a_warning_after_up(bystander: User) -> None:
    """`up` refreshes the written ssh config beside the session start; when that fails the
    box is still up: one warning line, exit 0, and the old config is left as it was."""
    bystander.devbox("ssh-config", "--write", check=True)
    before = bystander.ssh_config.read_text()
    # Its temporary file's name taken by a folder: the write fails (even as root).
    (bystander.ssh_config.parent / (bystander.ssh_config.name + ".tmp")).mkdir()
    result = bystander.devbox("up", "late", "--no-attach")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("devbox: warning: ")]
    assert len(warnings) == 1 and "ssh config not refreshed" in warnings[0], err
    assert "Traceback" not in err
    assert bystander.ssh_config.read_text() == before
    boxes = {b["name"]: b for b in json.loads(bystander.devbox("ls", "--json").stdout)}
    assert boxes["late"]["state"] == "running"
