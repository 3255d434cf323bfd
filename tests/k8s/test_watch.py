"""The backend's watch keeps reporting across a real API server restart (and the 410 Gone
or broken stream that comes with it). It runs on a private control plane, so restarting
its API server disturbs no other test."""

from __future__ import annotations

import getpass
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from devbox.backends.kubernetes import KubernetesBackend
from devbox.backends.kubernetes.pods import label_value
from devbox.config import Config
from tests.k8s.conftest import Cluster


def _pod(name: str, box: str) -> str:
    return f"""apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels:
    app.kubernetes.io/managed-by: devbox
    devbox.io/state: claimed
    devbox.io/owner: {label_value(getpass.getuser())}
    devbox.io/box: {box}
spec:
  containers: [{{name: box, image: devbox/box:test}}]
"""


def _kubectl(cluster: Cluster, *args: str, input: str | None = None) -> None:
    done = cluster.kubectl_run(*args, input=input.encode() if input else None)
    assert done.returncode == 0, done.stderr


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _restart_apiserver(cluster: Cluster) -> subprocess.Popen[bytes]:
    """Stop the API server and start it again with the same command line and environment."""
    folder = cluster.kubeconfig.parent
    binary = f"{folder}/kwok/clusters/devbox/bin/kube-apiserver"
    pid = int(
        subprocess.run(
            ["pgrep", "-f", f"^{binary} "], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    environ = dict(
        item.split(b"=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"=" in item
    )
    cwd = os.readlink(f"/proc/{pid}/cwd")
    # SIGKILL, as a crash or an OOM kill would: a graceful stop waits out every watch.
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _running(pid):
        assert time.monotonic() < deadline, "the API server did not stop"
        time.sleep(0.1)
    with open(folder / "apiserver-restarted.log", "ab") as log:
        return subprocess.Popen(
            [a.decode() for a in argv],
            env={k.decode(): v.decode() for k, v in environ.items()},
            cwd=cwd,
            stdout=log,
            stderr=log,
            start_new_session=True,
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
        _kubectl(private_cluster, "apply", "-f", "-", input=_pod("devbox-w1", "w1"))
        expect("ADDED", "w1")
        restarted = _restart_apiserver(private_cluster)
        # Once it answers again, a change made after the restart still arrives.
        deadline = time.monotonic() + 180
        while True:
            try:
                _kubectl(private_cluster, "apply", "-f", "-", input=_pod("devbox-w2", "w2"))
                break
            except AssertionError:
                if time.monotonic() > deadline or restarted.poll() is not None:
                    log = private_cluster.kubeconfig.parent / "apiserver-restarted.log"
                    tail = log.read_text(errors="replace").splitlines()[-15:]
                    raise AssertionError(
                        f"the API server did not come back (exit {restarted.poll()}):\n"
                        + "\n".join(tail)
                    ) from None
                time.sleep(0.5)
        expect("ADDED", "w2")
        _kubectl(private_cluster, "delete", "pod", "devbox-w1", "--wait=false")
        expect("DELETED", "w1")
    finally:
        stop.set()
