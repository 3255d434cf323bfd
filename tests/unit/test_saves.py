"""devbox.saves, pure: the release request a local box's backend writes (and its keeper
reads), the results an agent publishes, and how a result reads; the grace period of a
pod's deletion that gives its processes their limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from devbox import saves
from devbox.backends.kubernetes import pods
from devbox.backends.local import keeper
from devbox.protocol import SaveResult


def result(pid: int, status: str, saved: list[str], detail: str = "") -> SaveResult:
    return {
        "pid": pid,
        "cmd": "python train.py",
        "status": status,
        "saved": saved,
        "detail": detail,
    }


def test_a_release_request_gives_a_deadline_and_a_reason() -> None:
    text = saves.request(120, "idle", now=1000.0)
    assert saves.read_request(text) == (1120.0, "idle")
    assert saves.read_request(saves.request(0, "down", now=5.0)) == (0.0, "down")  # --now
    assert saves.read_request(saves.request(1e9, "x", now=0.0)) == (saves.MAX_LIMIT, "x")
    for bad in ("", "{", "[]", '{"limit": "x", "at": 1}', '{"limit": NaN, "at": 1}'):
        assert saves.read_request(bad)[0] == 0.0, bad


def test_the_keeper_reads_the_limit_from_the_agents_release_file(tmp_path: Path) -> None:
    path = tmp_path / "release.json"
    argv = ["python", "-m", "devbox", "agent", "--release-file", str(path)]
    assert keeper.release_limit(argv) == 0.0  # none written: the usual grace
    path.write_text(saves.request(45, "down"))
    assert keeper.release_limit(argv) == 45.0
    path.write_text(json.dumps({"limit": float("inf")}))
    assert keeper.release_limit(argv) == keeper.MAX_SAVE
    path.write_text("garbage")
    assert keeper.release_limit(argv) == 0.0
    assert keeper.release_limit(["python", "--release-file"]) == 0.0
    assert keeper.MAX_SAVE == saves.MAX_LIMIT


def test_results_round_trip_and_fit_an_annotation() -> None:
    results = [
        result(10, "saved", ["/home/u/ckpt.pt"]),
        result(11, "timeout", [], "no answer within 120s"),
        result(12, "no-handler", [], "probed, no probe.on_release"),
    ]
    assert saves.decode(saves.encode(results)) == results
    many = [result(1, "saved", [f"/h/{i:04}.pt" for i in range(2000)])]
    cut = saves.decode(saves.encode(many))
    assert cut[0]["pid"] == 1 and 0 < len(cut[0]["saved"]) < 2000
    assert len(saves.encode(many)) <= 8192
    for bad in ("", "nope", "{}", '[{"pid": "1"}]', "[" * 10000):
        assert saves.decode(bad) == [], bad


def test_a_result_reads_as_one_line() -> None:
    assert saves.line(result(10, "saved", ["/a.pt", "/b.pt"])) == (
        "process 10 (python train.py) saved /a.pt, /b.pt"
    )
    assert saves.line(result(11, "timeout", [], "no answer within 4s")) == (
        "process 11 (python train.py): not saved: no answer within 4s"
    )
    assert saves.line(result(12, "failed", [])) == "process 12 (python train.py): not saved: failed"


def test_a_deletion_gives_the_limit_and_the_agents_margin() -> None:
    assert pods.release_grace(120) == 128
    assert pods.release_grace(0) == 8  # --now: the agent only ends the sessions
    assert pods.release_grace(0.5) == 9


def test_save_timeout_is_validated_in_one_line(tmp_path: Path) -> None:
    import pytest

    from devbox import config
    from devbox.errors import UsageError

    path = tmp_path / "config.toml"
    assert config.load(tmp_path / "none.toml").save_timeout == 120.0
    path.write_text("save_timeout = 0\n")
    assert config.load(path).save_timeout == 0.0  # never ask
    for value, message in (
        ("-1", "save_timeout must be in [0, 3600] seconds (got -1)"),
        ("4000", "save_timeout must be in [0, 3600] seconds (got 4000)"),
        ("nan", "save_timeout must be in [0, 3600] seconds (got nan)"),
        ('"2m"', "save_timeout must be a float"),
    ):
        path.write_text(f"save_timeout = {value}\n")
        with pytest.raises(UsageError) as caught:
            config.load(path)
        assert caught.value.message == f"config file {path}: {message}", value


def test_the_keeper_runs_isolated_as_an_import_of_its_module() -> None:
    """What the launcher runs (keeper.RUN under -I -S: no site-packages, no devbox package
    on the path) reaches the keeper's main: without its arguments it says how to run it."""
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", keeper.RUN], capture_output=True, timeout=30
    )
    assert out.returncode == 2
    assert b"usage: keeper.py LOCK_FILE READY_FD AGENT_ARGV..." in out.stderr
