"""`devbox run` on a Kubernetes box: sync and runs through the API server's port-forward."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.k8s.conftest import KubeUser


def _wait_ended(kube: KubeUser, box: str, run: str) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while True:
        runs = json.loads(kube.devbox("runs", box, "--json", check=True).stdout)
        found = next(r for r in runs if r["id"] == run)
        if found["ended_at"]:
            return found  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, found
        time.sleep(0.3)


def test_run_syncs_and_records_in_a_pod(kube: KubeUser, tmp_path: Path) -> None:
    kube.devbox("up", "kr", "--no-attach", check=True)
    project = tmp_path / "proj"
    project.mkdir()
    (project / "data.txt").write_text("first\n")
    (project / ".gitignore").write_text("*.ckpt\n")
    (project / "big.ckpt").write_text("never synced\n")
    script = "cat data.txt; ls; exit 3"
    started = kube.devbox("run", "--box", "kr", "--sync", str(project), "-d", "--", script)
    assert started.returncode == 0, started.stderr
    run = started.stdout.decode().split()[0]
    record = _wait_ended(kube, "kr", run)
    assert record["exit_code"] == 3 and record["state"] == "failed"
    log = kube.devbox("logs", "kr", run, check=True).stdout.decode()
    assert "first" in log and "data.txt" in log and "big.ckpt" not in log
    # A second run syncs only what changed.
    (project / "data.txt").write_text("second\n")
    again = kube.devbox("run", "--box", "kr", "--sync", str(project), "-d", "--", "cat data.txt")
    assert again.returncode == 0, again.stderr
    assert b"1 changed file (data.txt)" in again.stderr
    second = again.stdout.decode().split()[0]
    assert _wait_ended(kube, "kr", second)["exit_code"] == 0
    assert kube.devbox("logs", "kr", second, check=True).stdout.decode().strip() == "second"
