"""A box's Lease (its agent's heartbeat) belongs to its pod and goes with it."""

from __future__ import annotations

import json

from tests.k8s.conftest import KubeUser
from tests.waiting import wait_until


def _lease(kube: KubeUser, pod: str) -> dict[str, object] | None:
    got = kube.cluster.kubectl_run("get", "lease", pod, "-n", kube.namespace, "-o", "json")
    return json.loads(got.stdout) if got.returncode == 0 else None


def test_a_short_lived_box_leaves_no_lease(kube: KubeUser) -> None:
    """The first heartbeat goes out at once; it must already name the pod as its owner,
    or a box released before the second one leaves its Lease behind for good."""
    up = kube.devbox("up", "brief", "--no-attach", "--json", check=True)
    pod = json.loads(up.stdout)["place"]
    lease = wait_until(lambda: _lease(kube, pod), timeout=60, what="the box's Lease")
    uid = json.loads(
        kube.cluster.kubectl_run("get", "pod", pod, "-n", kube.namespace, "-o", "json").stdout
    )["metadata"]["uid"]
    owners = lease["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [("Pod", pod, uid)]
    kube.devbox("down", "brief", check=True)
    # The garbage collector deletes what the pod owned.
    wait_until(lambda: _lease(kube, pod) is None, timeout=90, what="the Lease to go")
