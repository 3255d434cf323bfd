"""The laptop's half of a gated `devbox run` start (devbox.runs.remote.GatedStart), against
real processes standing in for the helper at the far end of ssh: one that waits for its spec
as boxside's `start -` does, and one that refuses "-" as a devbox older than the gate does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from devbox.runs import boxside
from devbox.runs.remote import GatedStart

WAITS = textwrap.dedent(
    f"""
    import sys
    print({boxside.READY!r}, flush=True)
    spec = sys.stdin.readline().strip()
    if not spec:
        sys.exit(0)
    print("spec", spec, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(3)
    """
)
OLDER = "import sys; print('devbox: error: malformed run spec', file=sys.stderr); sys.exit(2)"


def _helper(code: str) -> GatedStart:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return GatedStart(backend=None, box=None, proc=proc)  # type: ignore[arg-type]


def test_go_sends_the_spec_and_relays_both_streams_and_the_status(
    capfd: pytest.CaptureFixture[str],
) -> None:
    gated = _helper(WAITS)
    assert gated.ready()
    assert gated.go("c3BlYw") == 3
    out, err = capfd.readouterr()
    assert out == "spec c3BlYw\n"
    assert err == "to stderr\n"


def test_an_older_helper_is_not_ready_and_says_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    gated = _helper(OLDER)
    assert not gated.ready()
    assert gated.proc.returncode == 2
    assert capfd.readouterr() == ("", "")  # its refusal is not the user's news


def test_cancel_ends_a_waiting_helper_with_nothing_started() -> None:
    gated = _helper(WAITS)
    assert gated.ready()
    gated.cancel()
    assert gated.proc.returncode == 0  # it read no spec (3 would mean it went on)
