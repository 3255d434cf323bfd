"""The backend's watch keeps reporting across a real API server restart (and the 410 Gone
or broken stream that comes with it). It runs on a private control plane, so restarting
its API server disturbs no other test."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devbox.backends.kubernetes import KubernetesBackend
from devbox.backends.kubernetes.identity import Identity
from devbox.config import Config
from tests.k8s.conftest import Cluster


def _pod(name: str, box: str, owner: Identity) -> str:
    return f"""apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels:
    app.kubernetes.io/managed-by: devbox
    devbox.io/state: claimed
    devbox.io/owner: {owner.label}
    devbox.io/box: {box}
  annotations:
    devbox.io/owner-name: {json.dumps(owner.username)}
spec:
  containers: [{{name: box, image: devbox/box:test}}]
"""


def _kubectl(cluster: Cluster, *args: str, input: str | None = None) -> None:
    done = cluster.kubectl_run(*args, input=input.encode() if input else None)
    assert done.returncode == 0, done.stderr


def _applied(cluster: Cluster, manifest: str) -> bool:
    applied = cluster.kubectl_run(
        "apply", "--request-timeout=10s", "-f", "-", input=manifest.encode()
    )
    return applied.returncode == 0


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _apiserver_pid(folder: Path) -> int | None:
    binary = f"{folder}/kwok/clusters/devbox/bin/kube-apiserver"
    found = subprocess.run(["pgrep", "-f", f"^{binary} "], capture_output=True, text=True)
    return int(found.stdout.split()[0]) if found.stdout.split() else None


def _kill(pid: int) -> None:
    # SIGKILL, as a crash or an OOM kill would: a graceful stop waits out every watch.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _running(pid):
        assert time.monotonic() < deadline, "the API server did not stop"
        time.sleep(0.1)


def _restart_apiserver(cluster: Cluster, answers: Callable[[], bool]) -> None:
    """Kill the API server, start it again with the same command line, environment and
    folder, and wait until `answers()`. A start that exits or stays silent for a minute
    (this test's harness, not devbox, failing) is killed and made again, twice at most;
    the failure then says how it exited and the tail of its log."""
    folder = cluster.kubeconfig.parent
    pid = _apiserver_pid(folder)
    assert pid is not None, "no API server to restart"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    environ = dict(
        item.split(b"=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    cwd = os.readlink(f"/proc/{pid}/cwd")
    _kill(pid)
    log_path = folder / "apiserver-restarted.log"
    for attempt in range(3):
        with open(log_path, "ab") as log:
            log.write(f"--- start {attempt}\n".encode())
            log.flush()
            restarted = subprocess.Popen(
                [a.decode() for a in argv],
                env={k.decode(): v.decode() for k, v in environ.items()},
                cwd=cwd,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while restarted.poll() is None and time.monotonic() < deadline:
            if answers():
                return
            time.sleep(0.5)
        _kill(restarted.pid)
        restarted.wait()
    tail = log_path.read_text(errors="replace").splitlines()[-20:]
    raise AssertionError(
        f"the API server did not come back (last exit {restarted.returncode}):\n" + "\n".join(tail)
    )


@pytest.mark.timeout(400)  # starts a control plane of its own
def test_watch_survives_an_api_server_restart(
    private_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(private_cluster.kubeconfig))
    backend = KubernetesBackend(config=Config(namespace="default"), progress=lambda _: None)
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    stop = threading.Event()

    def follow() -> None:
        for kind, box in backend.watch(stop):
            events.put((kind, box.name))

    threading.Thread(target=follow, daemon=True).start()

    def expect(kind: str, name: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {kind} event for {name}"
            try:
                if events.get(timeout=left) == (kind, name):
                    return
            except queue.Empty:
                continue

    try:
        _kubectl(private_cluster, "apply", "-f", "-", input=_pod("devbox-w1", "w1", backend.me))
        expect("ADDED", "w1")
        # Once it answers again, a change made after the restart still arrives.
        _restart_apiserver(
            private_cluster, lambda: _applied(private_cluster, _pod("devbox-w2", "w2", backend.me))
        )
        expect("ADDED", "w2")
        _kubectl(private_cluster, "delete", "pod", "devbox-w1", "--wait=false")
        expect("DELETED", "w1")
    finally:
        stop.set()
