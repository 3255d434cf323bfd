"""`import devbox` and `devbox --help` must stay light: no textual, no kubernetes, no asyncssh."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("textual", "kubernetes", "asyncssh", "pynvml", "rich")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def _loaded(body: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body, heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def test_import_devbox_is_light() -> None:
    assert _loaded("import devbox, devbox.cli, devbox.boxes, devbox.protocol") == []


def test_help_is_light() -> None:
    body = (
        "import contextlib, io\nfrom devbox.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n    except SystemExit: pass"
    )
    assert _loaded(body) == []


def test_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "devbox", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("up", "ls", "down", "ssh", "proxy", "ssh-config", "agent"):
        assert f"    {command}" in out


def test_importing_the_ssh_sides_prints_nothing() -> None:
    """A library's deprecation of what devbox never uses is not the user's news: with the
    default warning filters, as `devbox ssh` and the agent run, importing either side of
    SSH writes nothing to stderr (cryptography 51 deprecates DSA, which asyncssh names at
    import; every one-line error came out under eleven lines of warnings)."""
    for module in ("devbox.ssh.client", "agent.server"):
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=True
        )
        assert done.stderr == "", (module, done.stderr)
