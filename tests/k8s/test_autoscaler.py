"""`devbox autoscaler` against the real control plane, running as its own ServiceAccount
with the RBAC of images/k8s/autoscaler.yaml, with real agents heartbeating their Leases
and simulated GPUs; short timeouts."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import nvml_sim
from tests.conftest import REPO, ls_table
from tests.k8s.conftest import Cluster, KubeUser, Node, new_namespace, pinned, set_profiles
from tests.terminal import Terminal
from tests.waiting import wait_until

DEVBOX = f"{sys.executable} -m devbox"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settings(metrics_port: int) -> str:
    # The agents heartbeat every 10 s: a healthy one is never silent for 22.
    return f"""
idle_timeout = 40
warning = 10
grace = 0
interval = 1
unhealthy_after = 22
unhealthy_release_after = 600
metrics_port = {metrics_port}
[[pool]]
profile = "default"
gpus = 0
size = 2
"""


def _notice(term: Terminal, target: str, text: str, done: threading.Event) -> threading.Event:
    """Set once `text` has been on screen: screen shows a message for a few seconds only,
    maybe while the test waits for something else on a loaded machine."""
    seen = threading.Event()

    def watch() -> None:
        while not seen.is_set() and not done.is_set():
            if text in term.screen(target):
                seen.set()
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return seen


def _wait(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    return wait_until(check, timeout, what, every=0.3)


class Kube:
    def __init__(self, kube: KubeUser) -> None:
        self.kube, self.ns, self.cluster = kube, kube.namespace, kube.cluster

    def json(self, *args: str) -> Any:
        done = self.cluster.kubectl_run(*args, "-n", self.ns, "-o", "json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.json("get", "pods", "-l", selector)["items"]
        return items

    def pod(self, name: str) -> dict[str, Any] | None:
        done = self.cluster.kubectl_run("get", "pod", name, "-n", self.ns, "-o", "json")
        return json.loads(done.stdout) if done.returncode == 0 else None

    def ready_warm(self) -> list[str]:
        return [
            p["metadata"]["name"]
            for p in self.pods("devbox.io/state=warm")
            if p["status"].get("phase") == "Running"
            and "devbox.io/host-key" in (p["metadata"].get("annotations") or {})
            and not p["metadata"].get("deletionTimestamp")
        ]

    def events(self, pod: str) -> list[str]:
        items = self.json("get", "events", "--field-selector", f"involvedObject.name={pod}")
        return [
            e["reason"]
            for e in items["items"]
            if (e.get("source") or {}).get("component") == "devbox-autoscaler"
        ]

    def sa_kubeconfig(self, path: Path) -> Path:
        token = self.cluster.kubectl_run(
            "create", "token", "devbox-autoscaler", "-n", self.ns, "--duration", "1h"
        )
        assert token.returncode == 0, token.stderr
        admin = json.loads(
            self.cluster.kubectl_run("config", "view", "--raw", "--minify", "-o", "json").stdout
        )
        cluster = admin["clusters"][0]["cluster"]
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": cluster}],
                    "users": [{"name": "sa", "user": {"token": token.stdout.decode().strip()}}],
                    "contexts": [
                        {
                            "name": "sa",
                            "context": {"cluster": "c", "user": "sa", "namespace": self.ns},
                        }
                    ],
                    "current-context": "sa",
                }
            )
        )
        return path


def _runner_folder(cluster: Cluster, pod: dict[str, Any]) -> Path:
    """Where the pod runner keeps this pod's agent files (its simulated GPUs among them)."""
    data = (cluster.kubeconfig.parent / "runner").resolve()
    short = Path("/tmp/dbxr") / hashlib.sha1(str(data).encode()).hexdigest()[:6]
    meta = pod["metadata"]
    key = hashlib.sha1(f"{meta['namespace']}/{meta['name']}/{meta['uid']}".encode()).hexdigest()
    return short / key[:8]


def _agent_pid(ns: str, pod: str) -> int:
    want = f"\0--pod\0{pod}\0--namespace\0{ns}\0".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if want in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no agent for {ns}/{pod}")


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "devbox", "autoscaler"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )


@pytest.mark.timeout(420)
def test_autoscaler_on_the_real_control_plane(kube: KubeUser, tmp_path: Path) -> None:
    k = Kube(kube)
    applied = k.cluster.kubectl_run(
        "apply", "-n", k.ns, "-f", str(REPO / "images/k8s/autoscaler.yaml")
    )
    assert applied.returncode == 0, applied.stderr
    port = _free_port()
    patch = json.dumps({"data": {"autoscaler.toml": _settings(port)}})
    done = k.cluster.kubectl_run(
        "patch", "configmap", "devbox-autoscaler", "-n", k.ns, "--type", "merge", "-p", patch
    )
    assert done.returncode == 0, done.stderr
    # As its Deployment runs it: its own ServiceAccount, and nothing more.
    env = dict(kube.user.env, KUBECONFIG=str(k.sa_kubeconfig(tmp_path / "sa.kubeconfig")))
    log = tmp_path / "autoscaler.log"
    procs = [_start(env, log)]
    term = Terminal(kube.user.env, Path(kube.user.env["TMUX_TMPDIR"]))
    silent_pid = 0
    stop_watching = threading.Event()  # ends the screen watcher started below
    try:
        # The warm pool is made, then refilled after claims.
        first_pool = set(
            _wait("a warm pool of two", lambda: len(k.ready_warm()) == 2 and k.ready_warm())
        )
        boxes = {}

        def up(name: str, gpus: str) -> str:
            done = kube.devbox("up", name, "--gpus", gpus, "--no-attach", "--json", check=True)
            boxes[name] = json.loads(done.stdout)
            return str(boxes[name]["place"])

        def lease_gpu(name: str) -> float:
            lease = k.json("get", "lease", boxes[name]["place"])
            return float(lease["metadata"]["annotations"].get("devbox.io/gpu-util", 0))

        # Each step below starts a box's clock right before what is checked of it, so
        # that a loaded machine's slowness cannot move a warning before its check.
        kept_pod = up("kept", "0")
        assert kept_pod in first_pool and kept_pod.startswith("devbox-warm-")
        for name in ("train", "silent"):  # training with nobody typing: busy GPUs
            pod = k.pod(up(name, "1"))
            nvml_sim.write(_runner_folder(k.cluster, pod) / "gpus", [nvml_sim.SimGpu(util=93)])  # type: ignore[arg-type]
        refilled = _wait(
            "the pool refilled",
            lambda: len(k.ready_warm()) == 2 and kept_pod not in k.ready_warm() and k.ready_warm(),
        )
        assert set(refilled) - first_pool
        # At the priority of every box (the cluster's default here): a claimed warm pod
        # is never preemptible; the autoscaler yields unclaimed ones to pending work.
        spec = k.pod(sorted(refilled)[0])["spec"]  # type: ignore[index]
        assert "priorityClassName" not in spec and spec["priority"] == 0
        assert k.pod(kept_pod)["spec"]["priority"] == 0  # type: ignore[index]
        kube.devbox("keep", "kept", "--for", "90s", check=True)
        keep_until = float(k.pod(kept_pod)["metadata"]["annotations"]["devbox.io/keep-until"])  # type: ignore[index]

        idle_pod = up("idle", "0")
        assert idle_pod.startswith("devbox-warm-")  # from the refilled pool
        where = kube.devbox(
            "ssh", "idle", "--", 'echo kept-home > notes.txt; echo "$HOME $PWD"', check=True
        )
        home, cwd = where.stdout.decode().split()
        assert "devbox-homes" in home and cwd == home  # the owner's folder in the home volume
        # Attached, typing nothing (input is activity); the shell starts in $HOME (~).
        shell = term.start(f"{DEVBOX} ssh idle")
        term.wait_for(shell, ":~", timeout=30)
        warned_on_screen = _notice(term, shell, "devbox: box idle has been idle", stop_watching)

        # The idle box is warned: in its session, on the pod, in `devbox ls`.
        assert warned_on_screen.wait(60), term.screen(shell)
        release_at = float(k.pod(idle_pod)["metadata"]["annotations"]["devbox.io/release-at"])  # type: ignore[index]
        row = ls_table(kube.devbox("ls", check=True).stdout.decode())["idle"]
        assert row["RELEASE"].startswith("in ") and row["KEPT"] == "-", row

        # Restart mid-way: the recorded warning stands; nothing is warned or released twice.
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        procs.append(_start(env, log))
        _wait("the idle box's release", lambda: k.pod(idle_pod) is None, timeout=60)
        assert time.time() >= release_at - 1
        assert k.events(idle_pod).count("DevboxReleaseWarning") == 1
        assert k.events(idle_pod).count("DevboxReleased") == 1
        explained = kube.devbox("explain", "idle", check=True).stdout.decode()
        assert "box idle was released at" in explained and "(idle)" in explained
        assert "DevboxReleased" in explained

        # The kept box was left alone all this while (idle longer than the idle box).
        kept = k.pod(kept_pod)["metadata"]  # type: ignore[index]
        assert time.time() < keep_until and "devbox.io/release-at" not in kept["annotations"]

        _wait("silent's busy GPU in its Lease", lambda: lease_gpu("silent") >= 90, timeout=40)
        silent_pid = _agent_pid(k.ns, boxes["silent"]["place"])
        os.kill(silent_pid, signal.SIGSTOP)  # its agent stops heartbeating

        # The silent agent is marked unhealthy and reported, not released.
        silent_pod = boxes["silent"]["place"]
        _wait(
            "silent marked unhealthy",
            lambda: "devbox.io/unhealthy-since" in k.pod(silent_pod)["metadata"]["annotations"],  # type: ignore[index]
        )
        listing = kube.devbox("ls", check=True)
        row = ls_table(listing.stdout.decode())["silent"]
        assert row["RELEASE"] == "unhealthy" and b"agent silent for" in listing.stderr
        assert "DevboxAgentSilent" in k.events(silent_pod)
        assert k.pod(silent_pod) is not None

        # The kept box is warned once its keep is over.
        warned = _wait(
            "kept warned after its keep",
            lambda: k.pod(kept_pod)["metadata"]["annotations"].get("devbox.io/release-at"),  # type: ignore[index]
            timeout=60,
        )
        assert float(warned) > keep_until

        # Another restart releases nothing twice.
        procs[-1].terminate()
        procs[-1].wait(timeout=20)
        procs.append(_start(env, log))
        time.sleep(5)
        assert k.events(idle_pod).count("DevboxReleased") == 1

        # Training with nobody typing was never warned.
        train_pod = boxes["train"]["place"]
        assert "devbox.io/release-at" not in k.pod(train_pod)["metadata"]["annotations"]  # type: ignore[index]
        assert k.events(train_pod) == []
        why = kube.devbox("explain", "train", check=True).stdout.decode()
        assert ": busy: in use: GPU 93%" in why

        # The home survived the release.
        kube.devbox("up", "idle", "--no-attach", check=True)
        again = kube.devbox("ssh", "idle", "--", "cat notes.txt", check=True)
        assert again.stdout == b"kept-home\n"

        # Metrics of the process that released the box, and the pool it keeps.
        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return str(r.read().decode())

        # The `up` above took a warm pod; the pool is refilled, and the metric says so.
        pool = 'devbox_warm_pool_pods{gpus="0",profile="default"} 2'
        text = _wait("the refilled pool in the metrics", lambda: pool in metrics() and metrics())
        assert 'devbox_boxes{status="unhealthy"} 1' in text
        _wait(
            "a claim latency",
            lambda: "devbox_claim_latency_seconds_count 0" not in metrics(),
            timeout=30,
        )
        state = k.json("get", "configmap", "devbox-autoscaler-state")
        assert train_pod in json.loads(state["data"]["state.json"])["memory"]
    finally:
        stop_watching.set()
        if silent_pid:
            os.kill(silent_pid, signal.SIGCONT)
        term.close()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)
    text = log.read_text()
    assert "released box idle" in text and "Traceback" not in text, text
    # Its Role lists pods in its namespace only: pending GPU work is looked for there.
    assert "may not list pods in every namespace" in text


def test_a_bad_config_map_is_one_line_at_start(kube: KubeUser) -> None:
    k = Kube(kube)
    applied = k.cluster.kubectl_run(
        "apply", "-n", k.ns, "-f", str(REPO / "images/k8s/autoscaler.yaml")
    )
    assert applied.returncode == 0, applied.stderr
    # The shipped settings are valid as they are.
    ok = kube.devbox("autoscaler", "--once")
    assert ok.returncode == 0, ok.stderr
    patch = json.dumps({"data": {"autoscaler.toml": "warning = '2h'\n"}})
    done = k.cluster.kubectl_run(
        "patch", "configmap", "devbox-autoscaler", "-n", k.ns, "--type", "merge", "-p", patch
    )
    assert done.returncode == 0, done.stderr
    bad = kube.devbox("autoscaler", "--once")
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.decode().strip().splitlines() == [
        f"devbox: error: autoscaler config ConfigMap {k.ns}/devbox-autoscaler: "
        "warning (7200s) must be shorter than idle_timeout (3600s)"
    ]


def _plain_gpu_pod(name: str, node: Node, gpus: int = 1) -> bytes:
    """A pod that is not devbox's, asking for GPUs of `node` (kwok "runs" it)."""
    key, value = node.taint
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "train:1",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [{"key": key, "value": value, "effect": "NoSchedule"}],
        },
    }
    return json.dumps(body).encode()


class PoolScaler:
    """`devbox autoscaler` as its ServiceAccount (images/k8s/autoscaler.yaml), bound to
    one of images/k8s/cluster.yaml's ClusterRoles, keeping a pool of one warm pod of a
    one-GPU profile on the test's own 2-GPU node; its metrics and pass count."""

    def __init__(self, kube: KubeUser, node: Node, tmp_path: Path, *, clusterrole: str) -> None:
        self.k = k = Kube(kube)
        applied = k.cluster.kubectl_run(
            "apply", "-n", k.ns, "-f", str(REPO / "images/k8s/autoscaler.yaml")
        )
        assert applied.returncode == 0, applied.stderr
        self.binding = f"{clusterrole}-{k.ns}"
        bound = k.cluster.kubectl_run(
            "create", "clusterrolebinding", self.binding, "--clusterrole", clusterrole,
            "--serviceaccount", f"{k.ns}:devbox-autoscaler",
        )  # fmt: skip
        assert bound.returncode == 0, bound.stderr
        set_profiles(kube, pinned(node))
        self.port = _free_port()
        settings = (
            f'interval = 1\nmetrics_port = {self.port}\n[[pool]]\nprofile = "pinned"\nsize = 1\n'
        )
        patch = json.dumps({"data": {"autoscaler.toml": settings}})
        done = k.cluster.kubectl_run(
            "patch", "configmap", "devbox-autoscaler", "-n", k.ns, "--type", "merge", "-p", patch
        )
        assert done.returncode == 0, done.stderr
        env = dict(kube.user.env, KUBECONFIG=str(k.sa_kubeconfig(tmp_path / "sa.kubeconfig")))
        self.log = tmp_path / "autoscaler.log"
        self.proc = _start(env, self.log)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def passes(self) -> int:
        line = next(
            x for x in self.metrics().splitlines() if x.startswith("devbox_reconcile_passes")
        )
        return int(float(line.split()[1]))

    def stop(self) -> str:
        """Stops it; its log."""
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.k.cluster.kubectl_run("delete", "clusterrolebinding", self.binding)
        return self.log.read_text()


@pytest.mark.timeout(300)
def test_warm_pods_yield_to_pods_waiting_for_gpus(
    kube: KubeUser, own_node: Node, tmp_path: Path
) -> None:
    # It may see the pods waiting in every namespace (images/k8s/cluster.yaml's role).
    other = new_namespace(kube.cluster, agent_rbac=False)
    scaler = PoolScaler(kube, own_node, tmp_path, clusterrole="devbox-pending-pods-reader")
    k, metrics, passes = scaler.k, scaler.metrics, scaler.passes

    def on_node(name: str, ns: str = k.ns) -> bool:
        got = k.cluster.kubectl_run("get", "pod", name, "-n", ns, "-o", "json")
        return got.returncode == 0 and json.loads(got.stdout)["spec"].get("nodeName") == (
            own_node.name
        )

    try:
        (stale,) = _wait("a warm pod of the profile", lambda: k.ready_warm())
        # The administrator changes the profile: the pod of the old shape is replaced.
        set_profiles(kube, pinned(own_node).replace('cpu = "250m"', 'cpu = "260m"'))
        (first,) = _wait("the new shape's warm pod", lambda: set(k.ready_warm()) - {stale})
        _wait("the stale pod gone", lambda: k.pod(stale) is None)
        assert k.events(stale) == ["DevboxWarmStale"]
        (container,) = k.pod(first)["spec"]["containers"]  # type: ignore[index]
        assert container["resources"]["requests"]["cpu"] == "260m"
        # A user claims it; the pool is refilled: the node's two GPUs are taken.
        box = json.loads(
            kube.devbox(
                "up", "mine", "--profile", "pinned", "--no-attach", "--json", check=True
            ).stdout
        )
        assert box["place"] == first
        mine = k.pod(first)["metadata"]["uid"]  # type: ignore[index]
        (second,) = _wait(
            "the refilled pool", lambda: [w for w in k.ready_warm() if w != first and on_node(w)]
        )

        # Work that is not devbox's, in another namespace, wants a GPU: the unclaimed warm
        # pod makes way for it.
        made = k.cluster.kubectl_run(
            "apply", "-n", other, "-f", "-", input=_plain_gpu_pod("train", own_node)
        )
        assert made.returncode == 0, made.stderr
        _wait("the waiting pod scheduled on the node", lambda: on_node("train", other))
        assert "DevboxWarmYielded" in k.events(second)
        gone = k.pod(second)
        assert gone is None or gone["metadata"].get("deletionTimestamp")
        yielded = 'devbox_warm_pods_removed_total{reason="yield"}'
        assert any(x.startswith(yielded) and not x.endswith(" 0") for x in metrics().splitlines())

        # More work waits, and only the claimed box holds a GPU: it is never touched, and
        # the pool is not refilled onto the GPUs the work waits for.
        made = k.cluster.kubectl_run(
            "apply", "-n", k.ns, "-f", "-", input=_plain_gpu_pod("more", own_node)
        )
        assert made.returncode == 0, made.stderr
        _wait("the waiting pod seen", lambda: "devbox_gpu_pending_pods 1" in metrics())
        seen = passes()
        _wait("three more passes", lambda: passes() >= seen + 3, timeout=60)
        still = k.pod(first)
        assert still is not None and still["metadata"]["uid"] == mine
        assert not still["metadata"].get("deletionTimestamp")
        assert not [w for w in k.ready_warm() if on_node(w)]
        assert kube.devbox("ssh", "mine", "--", "echo", "ok", check=True).stdout == b"ok\n"
    finally:
        text = scaler.stop()
        k.cluster.kubectl_run("delete", "namespace", other, "--wait=false")
    assert f"yielded warm pod {second}" in text and "Traceback" not in text, text
    assert "may not list pods in every namespace" not in text


@pytest.mark.timeout(300)
def test_no_warm_pod_yields_to_a_pod_no_node_could_hold(
    kube: KubeUser, own_node: Node, tmp_path: Path
) -> None:
    """With the nodes readable (images/k8s/cluster.yaml's devbox-capacity-reader), a pod
    asking for more GPUs than any node has is not pending work a yield could help: else
    anyone who may create a pod empties the GPU pools for as long as it waits."""
    scaler = PoolScaler(kube, own_node, tmp_path, clusterrole="devbox-capacity-reader")
    k, metrics, passes = scaler.k, scaler.metrics, scaler.passes
    try:
        (warm,) = _wait("a warm pod of the profile", lambda: k.ready_warm())
        made = k.cluster.kubectl_run(
            "apply", "-n", k.ns, "-f", "-", input=_plain_gpu_pod("greedy", own_node, gpus=1000)
        )
        assert made.returncode == 0, made.stderr
        try:
            _wait(
                "the greedy pod seen", lambda: "devbox_gpu_pending_pods 1" in metrics(), timeout=30
            )
        except AssertionError:
            print(
                metrics(),
                k.cluster.kubectl_run("get", "pods", "-n", k.ns, "-o", "wide").stdout.decode(),
            )
            print(
                k.cluster.kubectl_run(
                    "get", "pod", "greedy", "-n", k.ns, "-o", "yaml"
                ).stdout.decode()
            )
            raise
        seen = passes()
        _wait("three more passes", lambda: passes() >= seen + 3, timeout=60)
        still = k.pod(warm)
        assert still is not None and not still["metadata"].get("deletionTimestamp")
        assert "DevboxWarmYielded" not in k.events(warm)
    finally:
        text = scaler.stop()
    assert "ask for more GPUs than any node has" in text and "Traceback" not in text, text
