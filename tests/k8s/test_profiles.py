"""Box profiles against the real control plane: the administrator's ConfigMap
devbox-profiles and the user's own config shape the pods (requests, node selector,
tolerations: the scheduler places them by it), and warm pools are per shape."""

from __future__ import annotations

import json
from typing import Any

from tests.k8s.conftest import KubeUser, Node, pinned, set_profiles

CONFIG = (
    'backend = "kubernetes"\nnamespace = "{ns}"\nhome_storage_class = "devbox-sim"\n'
    'image = "devbox/box:test"\nstart_timeout = 120\n'
)


def write_config(kube: KubeUser, extra: str = "") -> None:
    path = kube.user.home / ".config/devbox/config.toml"
    path.write_text(CONFIG.format(ns=kube.namespace) + extra)


def pod(kube: KubeUser, name: str) -> dict[str, Any] | None:
    got = kube.cluster.kubectl_run("get", "pod", name, "-n", kube.namespace, "-o", "json")
    return dict(json.loads(got.stdout)) if got.returncode == 0 else None


def up(kube: KubeUser, name: str, *args: str) -> dict[str, Any]:
    done = kube.devbox("up", name, "--no-attach", "--json", *args, timeout=180, check=True)
    return dict(json.loads(done.stdout))


def warm_pods(kube: KubeUser, profile: str) -> list[str]:
    got = kube.cluster.kubectl_run(
        "get", "pods", "-n", kube.namespace, "-o", "json",
        "-l", f"devbox.io/state=warm,devbox.io/profile={profile}",
    )  # fmt: skip
    items = json.loads(got.stdout)["items"]
    return sorted(
        p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")
    )


def test_a_cluster_profile_shapes_the_pod_and_the_users_own_replaces_it(
    kube: KubeUser, own_node: Node
) -> None:
    set_profiles(kube, pinned(own_node) + '[profiles.small]\ncpu = "200m"\n')
    write_config(kube, '[profiles.small]\ncpu = "300m"\n')
    listed = json.loads(kube.devbox("profiles", "--json", check=True).stdout)
    where = {p["name"]: p["source"] for p in listed}
    cfg = kube.user.home / ".config/devbox/config.toml"
    assert where == {
        "default": "built in",
        "pinned": f"ConfigMap {kube.namespace}/devbox-profiles",
        "small": f"config file {cfg}",
    }

    box = up(kube, "p1", "--profile", "pinned")
    assert box["spec"]["cpu"] == "250m" and box["spec"]["gpus"] == 1
    spec = pod(kube, box["place"])["spec"]  # type: ignore[index]
    (container,) = spec["containers"]
    # Exactly the profile's requests, no CPU or memory limit, its GPUs as the limit.
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "300Mi", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": own_node.name}
    # The API server adds its own not-ready/unreachable tolerations to every pod.
    mine = [t for t in spec["tolerations"] if not t["key"].startswith("node.kubernetes.io/")]
    key, value = own_node.taint
    assert mine == [{"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"}]
    # Only the toleration lets it onto the tainted node the selector names.
    assert spec["nodeName"] == own_node.name and box["extra"]["node"] == own_node.name
    assert kube.devbox("ssh", "p1", "--", "echo", "in", check=True).stdout == b"in\n"

    # The user's own profile of the same name replaces the cluster's whole.
    small = up(kube, "s1", "--profile", "small")
    (container,) = pod(kube, small["place"])["spec"]["containers"]  # type: ignore[index]
    assert container["resources"] == {"requests": {"cpu": "300m", "memory": "2Gi"}}

    # An unknown profile names the known ones; a bad ConfigMap is one line naming it.
    bad = kube.devbox("up", "x", "--profile", "gpu", "--no-attach")
    assert bad.returncode == 2 and bad.stderr.decode() == (
        "devbox: error: unknown profile 'gpu': the known profiles are default, pinned, small\n"
    )
    set_profiles(kube, '[profiles.small]\nmemory = "1Gb"\n')
    bad = kube.devbox("up", "x", "--no-attach")
    err = bad.stderr.decode()
    assert bad.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"devbox: error: ConfigMap {kube.namespace}/devbox-profiles: profiles.small.memory "
        "must be a memory quantity"
    ), err


def test_warm_pools_are_per_shape_and_one_priority_for_all(kube: KubeUser) -> None:
    set_profiles(kube, '[profiles.a]\ncpu = "200m"\n[profiles.b]\ncpu = "300m"\n')
    # devbox-box: a PriorityClass scripts/test-cluster makes (value 0).
    write_config(kube, 'priority_class = "devbox-box"\n')
    (a_pod,) = [
        b["place"]
        for b in json.loads(
            kube.devbox("pool", "warm", "--profile", "a", "--json", check=True).stdout
        )
    ]
    kube.devbox("pool", "warm", "--profile", "b", check=True)
    (b_pod,) = warm_pods(kube, "b")

    # A claim of profile a takes a's warm pod, never b's.
    warm_box = up(kube, "x", "--profile", "a")
    assert warm_box["place"] == a_pod and warm_pods(kube, "b") == [b_pod]
    cold_box = up(kube, "y", "--profile", "a")  # a's pool is empty now
    assert cold_box["place"] == "devbox-y"
    warm_spec = pod(kube, a_pod)["spec"]  # type: ignore[index]
    cold_spec = pod(kube, "devbox-y")["spec"]  # type: ignore[index]
    # A claimed warm box is exactly as preemptible as a cold one.
    assert warm_spec["priorityClassName"] == cold_spec["priorityClassName"] == "devbox-box"
    assert warm_spec["priority"] == cold_spec["priority"]

    # The administrator changes b: its old warm pod serves no claim of the new shape ...
    set_profiles(kube, '[profiles.a]\ncpu = "200m"\n[profiles.b]\ncpu = "400m"\n')
    new_b = up(kube, "z", "--profile", "b")
    assert new_b["place"] == "devbox-z" and warm_pods(kube, "b") == [b_pod]
    # ... and topping b's pool up replaces it.
    topped = kube.devbox("pool", "warm", "--profile", "b", "--json", check=True)
    assert f"deleted warm pod {b_pod}".encode() in topped.stderr
    (fresh,) = [b["place"] for b in json.loads(topped.stdout)]
    assert fresh != b_pod
    (container,) = pod(kube, fresh)["spec"]["containers"]  # type: ignore[index]
    assert container["resources"]["requests"]["cpu"] == "400m"
    assert warm_pods(kube, "b") == [fresh]
