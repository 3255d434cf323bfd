"""The Kubernetes backend against a real API server, scheduler and controller manager,
with kwok's simulated GPU nodes and real agents reached through the API server's
port-forward (client -> API server -> kwok -> agent)."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from devbox.protocol import home_folder
from tests.conftest import REPO, ls_table, make_user
from tests.k8s.conftest import Cluster, KubeUser, configure, kube_user, new_namespace
from tests.waiting import wait_until


def _one_line_error(result: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    lines = [ln for ln in err.splitlines() if ln.startswith("devbox: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_up_ssh_and_openssh_through_the_port_forward(kube: KubeUser) -> None:
    up = kube.devbox("up", "k1", "--gpus", "1", "--no-attach", "--json", check=True)
    box = json.loads(up.stdout)
    # Progress from the pod's events: the scheduler's decision is shown.
    assert b"created pod devbox-k1" in up.stderr and b"Scheduled:" in up.stderr
    assert box["backend"] == "kubernetes" and box["state"] == "running"
    assert box["spec"]["gpus"] == 1 and box["host_key_fingerprint"].startswith("SHA256:")
    # Both clients of `devbox ssh`: OpenSSH dialling this process's loopback end of the
    # port-forward (the default where ssh is installed), and the built-in asyncssh one.
    for client in ("auto", "builtin"):
        kube.user.env["DEVBOX_SSH_CLIENT"] = client
        hi = kube.devbox("ssh", "k1", "--", "echo", "hi", check=True)
        assert hi.stdout == b"hi\n", client
        assert kube.devbox("ssh", "k1", "--", "exit 7").returncode == 7, client
    del kube.user.env["DEVBOX_SSH_CLIENT"]
    kube.devbox("ssh-config", "--write", check=True)
    plain = kube.user.ssh("k1.devbox", "echo $DEVBOX_BOX; pwd")
    assert plain.returncode == 0, plain.stderr
    name, home = plain.stdout.decode().split()
    assert name == "k1" and home.endswith("/" + home_folder(box["owner"]))
    listing = json.loads(kube.devbox("ls", "--json", check=True).stdout)
    assert [(b["name"], b["state"]) for b in listing] == [("k1", "running")]
    kube.devbox("down", "k1", check=True)
    assert json.loads(kube.devbox("ls", "--json", check=True).stdout) == []


def test_twenty_claims_against_a_warm_pool_of_five(kube: KubeUser) -> None:
    warm = kube.devbox("pool", "warm", "--size", "5", "--json", check=True)
    pool = {b["place"] for b in json.loads(warm.stdout)}
    assert len(pool) == 5

    def claim(i: int) -> subprocess.CompletedProcess[bytes]:
        return kube.devbox("up", f"c{i}", "--no-attach", "--json", timeout=300)

    with ThreadPoolExecutor(max_workers=20) as threads:
        results = list(threads.map(claim, range(20)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-500:] for r in results]
    boxes = [json.loads(r.stdout) for r in results]
    pods = [b["place"] for b in boxes]
    assert len(set(pods)) == 20, "a pod was claimed twice"
    assert set(pods) & pool == pool, "every warm pod was claimed"
    assert sum(p.startswith("devbox-warm-") for p in pods) == 5
    assert json.loads(kube.devbox("pool", "ls", "--json", check=True).stdout) == []
    # A claimed warm pod serves its new owner.
    from_pool = next(b for b in boxes if b["place"].startswith("devbox-warm-"))
    out = kube.devbox("ssh", from_pool["name"], "--", "echo $DEVBOX_BOX", check=True)
    assert out.stdout.decode().strip() == from_pool["name"]


def test_more_gpus_than_any_node_has(kube: KubeUser) -> None:
    start = time.monotonic()
    result = kube.devbox("up", "huge", "--gpus", "9", "--no-attach")
    line = _one_line_error(result, 1)
    assert "no node can ever hold 9 GPU(s): the largest has 8" in line
    assert "free" in line
    assert time.monotonic() - start < 60  # said at once, not after the start timeout
    pods = kube.cluster.kubectl_run("get", "pods", "-n", kube.namespace, "-o", "name")
    assert pods.stdout.strip() == b""


def test_home_survives_down_and_up(kube: KubeUser) -> None:
    kube.devbox("up", "h1", "--no-attach", check=True)
    kube.devbox("ssh", "h1", "--", "echo kept > notes.txt", check=True)
    kube.devbox("down", "h1", check=True)
    kube.devbox("up", "h1", "--no-attach", check=True)
    again = kube.devbox("ssh", "h1", "--", "cat notes.txt", check=True)
    assert again.stdout == b"kept\n"


def test_agent_publishes_and_heartbeats(kube: KubeUser) -> None:
    box = json.loads(kube.devbox("up", "beat", "--no-attach", "--json", check=True).stdout)

    def pod() -> dict[str, Any]:
        got = kube.cluster.kubectl_run(
            "get", "pod", "-n", kube.namespace, box["place"], "-o", "json"
        )
        return dict(json.loads(got.stdout))

    ann = pod()["metadata"]["annotations"]
    assert ann["devbox.io/host-key-fingerprint"] == box["host_key_fingerprint"]
    # `up` does not wait for the agent's answer to the claim (it takes the key when it
    # knocks); the answer comes all the same, through the pod watch.
    wait_until(
        lambda: pod()["metadata"]["annotations"].get("devbox.io/owner-ack", "").startswith("SHA"),
        timeout=15,
        what="the agent's acknowledgement of its owner",
        every=0.2,
    )
    # Pod Security baseline: no runAsUser, so the token stays readable once the agent is
    # its owner's uid (pods.box_pod).
    assert "runAsUser" not in pod()["spec"]["securityContext"]
    deadline = time.monotonic() + 30
    while True:
        lease = kube.cluster.kubectl_run(
            "get", "lease", "-n", kube.namespace, box["place"], "-o", "json"
        )
        if lease.returncode == 0:
            break
        assert time.monotonic() < deadline, lease.stderr
        time.sleep(0.5)
    spec = json.loads(lease.stdout)
    assert spec["spec"]["holderIdentity"] == box["place"]
    assert float(spec["metadata"]["annotations"]["devbox.io/last-input"]) > 0


def test_bad_cluster_input(kube: KubeUser, tmp_path: Path) -> None:
    _one_line_error(kube.devbox("ls", "--context", "no-such-context"), 2)
    missing = _one_line_error(kube.devbox("up", "x", "--namespace", "no-such-ns", "--no-attach"), 2)
    assert "no-such-ns" in missing
    unreachable = tmp_path / "unreachable.yaml"
    unreachable.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: x}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    kube.user.env["KUBECONFIG"] = str(unreachable)
    line = _one_line_error(kube.devbox("ls"), 1)
    assert "cannot reach the Kubernetes API server at https://127.0.0.1:1" in line


def test_forbidden_without_rbac_and_enough_with_the_user_role(
    cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path
) -> None:
    outsider = make_user(tmp_path / "r", nvml_lib_dir)
    ns = new_namespace(cluster)
    configure(outsider, ns, cluster.restricted)
    try:
        line = _one_line_error(outsider.devbox("up", "r1", "--no-attach"), 1)
        assert "forbidden by the cluster's RBAC" in line
        # The documented least-privilege Role is enough for the whole cycle.
        role = cluster.kubectl_run("apply", "-n", ns, "-f", str(REPO / "images/k8s/user-role.yaml"))
        assert role.returncode == 0, role.stderr
        bound = cluster.kubectl_run(
            "create",
            "rolebinding",
            "-n",
            ns,
            "devbox-users",
            "--role",
            "devbox-user",
            "--user",
            "devbox-restricted",
        )
        assert bound.returncode == 0, bound.stderr
        outsider.devbox("up", "r1", "--no-attach", check=True)
        assert outsider.devbox("ssh", "r1", "--", "echo", "ok", check=True).stdout == b"ok\n"
        outsider.devbox("down", "r1", check=True)
    finally:
        cluster.kubectl_run("delete", "namespace", ns, "--wait=false")
        outsider.stop_all()


@pytest.mark.timeout(400)  # starts a control plane of its own
def test_timeout_ends_the_wait_for_busy_gpus(
    private_cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path
) -> None:
    kube = kube_user(private_cluster, tmp_path / "p", nvml_lib_dir)
    try:
        _fill_and_wait(kube)
    finally:
        kube.user.stop_all()


def _fill_and_wait(kube: KubeUser) -> None:
    # Fill a cluster of our own: four 8-GPU nodes and the 2-GPU one.
    for name, gpus in (("big0", 8), ("big1", 8), ("big2", 8), ("big3", 8), ("hog", 2)):
        kube.devbox("up", name, "--gpus", str(gpus), "--no-attach", check=True)
    start = time.monotonic()
    late = kube.devbox("up", "late", "--gpus", "2", "--no-attach", "--timeout", "4")
    line = _one_line_error(late, 1)
    assert time.monotonic() - start < 40
    assert "was not ready within 4s: waiting for free GPUs (" in line
    assert "nodes short of GPUs" in line
    assert b"0 GPU(s) free" in late.stderr
    pods = kube.cluster.kubectl_run("get", "pods", "-n", kube.namespace, "-o", "name")
    assert b"devbox-late" not in pods.stdout  # the waiting pod was withdrawn
    # Freeing GPUs lets the same claim through.
    kube.devbox("down", "hog", check=True)
    kube.devbox("up", "late", "--gpus", "2", "--no-attach", "--timeout", "60", check=True)


def test_stats_through_the_port_forward(kube: KubeUser) -> None:
    kube.devbox("up", "tk", "--gpus", "2", "--no-attach", check=True)
    out = kube.devbox("stats", "tk", "--json", "--count", "3", "--rate", "10", check=True)
    samples = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(samples) == 3
    assert [s["seq"] for s in samples] == sorted({s["seq"] for s in samples})
    # The pod's GPUs, as the simulated driver of its node reports them.
    assert [len(s["gpus"]) for s in samples] == [2, 2, 2]
    assert all(g["mem_total"] == 80 << 30 for g in samples[-1]["gpus"])
    agents = [p for p in samples[-1]["processes"] if "devbox agent" in p["cmdline"]]
    assert len(agents) == 1 and "--pod" in agents[0]["cmdline"]


def test_keep_annotates_the_pod(kube: KubeUser) -> None:
    kube.devbox("up", "kk", "--no-attach", check=True)
    kube.devbox("keep", "kk", "--for", "30m", check=True)
    (box,) = json.loads(kube.devbox("ls", "--json", check=True).stdout)
    assert 1700 < box["keep_until"] - time.time() <= 1800
    pod = kube.cluster.kubectl_run("get", "pod", box["place"], "-n", kube.namespace, "-o", "json")
    annotations = json.loads(pod.stdout)["metadata"]["annotations"]
    assert float(annotations["devbox.io/keep-until"]) == box["keep_until"]
    kube.devbox("keep", "kk", "--off", check=True)
    (box,) = json.loads(kube.devbox("ls", "--json", check=True).stdout)
    assert box["keep_until"] == 0


def test_a_box_from_the_warm_pool_is_idle_no_longer_than_its_age(kube: KubeUser) -> None:
    """Issue 16 (14f): AGE and IDLE both count from the claim. The warm pod's agent
    started (and began its activity clock) before anyone claimed it."""
    warm = json.loads(kube.devbox("pool", "warm", "--size", "1", "--json", check=True).stdout)
    pooled = warm[0]["place"]
    made = time.time()
    # A gap between the pod's start and the claim that whole seconds in `ls` can show.
    wait_until(lambda: time.time() > made + 4, timeout=10, what="the warm pod to age", every=0.5)
    box = json.loads(kube.devbox("up", "fromwarm", "--no-attach", "--json", check=True).stdout)
    assert box["place"] == pooled

    def listed() -> dict[str, Any] | None:
        found = json.loads(kube.devbox("ls", "--json", check=True).stdout)
        mine = next(b for b in found if b["name"] == "fromwarm")
        return mine if mine["last_activity"] > 0 else None  # the Lease carries activity

    mine = wait_until(listed, timeout=40, what="the box's activity on its Lease", every=1)
    # IDLE <= AGE: no activity clock runs from before the claim.
    assert mine["last_activity"] >= mine["created_at"], mine
    cells = ls_table(kube.devbox("ls", check=True).stdout.decode())["fromwarm"]
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def seconds(cell: str) -> int:
        return int(cell[:-1]) * units[cell[-1]]

    assert seconds(cells["IDLE"]) <= seconds(cells["AGE"]), cells
