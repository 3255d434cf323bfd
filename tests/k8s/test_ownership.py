"""Ownership on a shared cluster, tried by distinct Kubernetes users of one lab (client
certificates the test cluster's CA signs): alice owns boxes, mallory tries to take,
change or reach them. What stops her is the API server (images/k8s/policies.yaml) and
the agent, not the devbox client: she uses kubectl and ssh as well."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from devbox.protocol import home_folder, owner_label
from tests.conftest import make_user
from tests.k8s.conftest import (
    LAB,
    Cluster,
    KubeUser,
    configure,
    identity_kubeconfig,
    lab_namespace,
    token_kubeconfig,
)
from tests.waiting import wait_until

Person = Callable[..., KubeUser]


@pytest.fixture
def lab(cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path) -> Iterator[Person]:
    """Makes lab members in one namespace: person("alice") is a devbox user whose
    credentials say alice, whatever their laptop calls them (laptop_user=)."""
    ns = lab_namespace(cluster)
    made: list[KubeUser] = []

    def person(username: str, *, laptop_user: str = "", admin: bool = False) -> KubeUser:
        folder = tmp_path / f"p{len(made)}"
        user = make_user(folder, nvml_lib_dir)
        kubeconfig = (
            cluster.kubeconfig
            if admin
            else identity_kubeconfig(cluster, folder / "kube", username, LAB)
        )
        configure(user, ns, kubeconfig)
        if laptop_user:
            user.env.update(USER=laptop_user, LOGNAME=laptop_user)
        made.append(KubeUser(user, ns, cluster))
        return made[-1]

    yield person
    cluster.kubectl_run("delete", "namespace", ns, "--wait=false")
    for kube in made:
        kube.user.stop_all()


def _kubectl(
    kube: KubeUser, *args: str, input: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """kubectl as this person, in their namespace."""
    return kube.cluster.kubectl_run(
        "-n", kube.namespace, *args, kubeconfig=Path(kube.user.env["KUBECONFIG"]), input=input
    )


def _refused(done: subprocess.CompletedProcess[bytes], why: str) -> None:
    assert done.returncode != 0, f"allowed: {done.stdout!r}"
    assert why.encode() in done.stderr, done.stderr


def _pod(kube: KubeUser, name: str) -> dict[str, Any]:
    got = kube.cluster.kubectl_run("get", "pod", name, "-n", kube.namespace, "-o", "json")
    assert got.returncode == 0, got.stderr
    pod: dict[str, Any] = json.loads(got.stdout)
    return pod


def _up(kube: KubeUser, name: str, *extra: str) -> dict[str, Any]:
    done = kube.devbox("up", name, "--no-attach", "--json", *extra, timeout=180)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    box: dict[str, Any] = json.loads(done.stdout)
    return box


def _one_line(done: subprocess.CompletedProcess[bytes]) -> str:
    err = done.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.startswith("devbox: error: ")]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _user_key(kube: KubeUser) -> str:
    return (kube.user.home / ".config/devbox/id_ed25519.pub").read_text().strip()


def test_the_owner_is_who_the_api_server_says_not_the_laptop(lab: Person) -> None:
    # Each one's laptop claims to be the other.
    alice = lab("alice", laptop_user="mallory")
    mallory = lab("mallory", laptop_user="alice")
    box = _up(alice, "a1")
    assert box["owner"] == "alice"
    meta = _pod(alice, "devbox-a1")["metadata"]
    assert meta["annotations"]["devbox.io/owner-name"] == "alice"
    assert meta["labels"]["devbox.io/owner"] == owner_label("alice")
    # mallory's devbox sees none of alice's boxes and acts on none.
    assert json.loads(mallory.devbox("ls", "--json", check=True).stdout) == []
    assert "belongs to alice" in _one_line(mallory.devbox("down", "a1"))
    assert "belongs to alice" in _one_line(mallory.devbox("ssh", "a1", "--", "true"))
    assert _pod(alice, "devbox-a1")["metadata"]["uid"] == meta["uid"]  # untouched
    assert alice.devbox("ssh", "a1", "--", "echo", "mine", check=True).stdout == b"mine\n"


def test_the_cluster_refuses_mallory_what_her_devbox_would_not_do(lab: Person) -> None:
    alice, mallory = lab("alice"), lab("mallory")
    _up(alice, "a1")
    _up(mallory, "m1")  # she is a lab member like any other, with a box of her own
    mine = _user_key(mallory)
    _refused(
        _kubectl(
            mallory, "annotate", "--overwrite", "pod", "devbox-a1", f"devbox.io/owner-key={mine}"
        ),
        "belongs to alice",
    )
    _refused(
        _kubectl(
            mallory,
            "label",
            "--overwrite",
            "pod",
            "devbox-a1",
            f"devbox.io/owner={owner_label('mallory')}",
        ),
        "belongs to alice",
    )
    _refused(
        _kubectl(mallory, "annotate", "pod", "devbox-a1", "devbox.io/keep-until=9999999999"),
        "belongs to alice",
    )
    _refused(_kubectl(mallory, "delete", "pod", "devbox-a1", "--wait=false"), "belongs to alice")
    # Even alice cannot change what makes the box hers: another key goes through devbox.
    _refused(
        _kubectl(
            alice, "annotate", "--overwrite", "pod", "devbox-a1", f"devbox.io/owner-key={mine}"
        ),
        "keeps its owner, owner key, name and state",
    )
    # Pods of her own that would pass for alice's, or reach the homes.
    spec = _pod(mallory, "devbox-m1")

    def variant(name: str, change: Callable[[dict[str, Any]], None]) -> bytes:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": dict(spec["metadata"]["labels"], **{"devbox.io/box": name}),
                "annotations": {
                    k: v
                    for k, v in spec["metadata"]["annotations"].items()
                    if k in ("devbox.io/owner-key", "devbox.io/owner-name")
                },
            },
            "spec": {
                k: v
                for k, v in spec["spec"].items()
                if k
                in ("containers", "volumes", "serviceAccountName", "securityContext", "tolerations")
            },
        }
        change(body)
        return json.dumps(body).encode()

    def as_alice(body: dict[str, Any]) -> None:
        body["metadata"]["annotations"]["devbox.io/owner-name"] = "alice"
        body["metadata"]["labels"]["devbox.io/owner"] = owner_label("alice")

    def warm(body: dict[str, Any]) -> None:
        body["metadata"]["labels"]["devbox.io/state"] = "warm"

    def autoscaler_account(body: dict[str, Any]) -> None:
        body["spec"]["serviceAccountName"] = "devbox-autoscaler"

    def whole_homes(body: dict[str, Any]) -> None:
        del body["metadata"]["labels"]["app.kubernetes.io/managed-by"]  # not even a box
        body["spec"]["containers"][0]["volumeMounts"][0] = {"name": "homes", "mountPath": "/homes"}

    def alices_home(body: dict[str, Any]) -> None:
        body["spec"]["containers"][0]["volumeMounts"][0]["subPath"] = home_folder("alice")

    for name, change, why in (
        ("fake-a", as_alice, "devbox.io/owner-name must be mallory"),
        ("fake-w", warm, "only the autoscaler makes warm pods"),
        ("fake-s", autoscaler_account, "run as the service account devbox-agent"),
        ("fake-h", whole_homes, "only as your own folder, subPath u-mallory"),
        ("fake-ah", alices_home, "only as your own folder, subPath u-mallory"),
    ):
        _refused(_kubectl(mallory, "create", "-f", "-", input=variant(name, change)), why)
    # ... and what it refused made nothing.
    listed = _kubectl(mallory, "get", "pods", "-o", "name").stdout.decode().split()
    assert sorted(listed) == ["pod/devbox-a1", "pod/devbox-m1"]


def test_a_warm_pod_is_claimed_only_for_oneself(lab: Person) -> None:
    admin = lab("admin", admin=True)  # the autoscaler's part: it makes warm pods
    alice, mallory = lab("alice"), lab("mallory")
    _refused(mallory.devbox("pool", "warm", "--size", "1"), "only the autoscaler makes warm pods")
    _up(mallory, "m0")  # makes her key (before the pool: this claim would take its pod)
    mine = _user_key(mallory)
    pool = json.loads(admin.devbox("pool", "warm", "--size", "1", "--json", check=True).stdout)
    warm = pool[0]["place"]
    version = _pod(admin, warm)["metadata"]["resourceVersion"]
    claim_for_alice = {
        "metadata": {
            "resourceVersion": version,
            "labels": {
                "devbox.io/state": "claimed",
                "devbox.io/box": "x",
                "devbox.io/owner": owner_label("alice"),
            },
            "annotations": {"devbox.io/owner-name": "alice", "devbox.io/owner-key": mine},
        }
    }
    _refused(
        _kubectl(mallory, "patch", "pod", warm, "--type=merge", "-p", json.dumps(claim_for_alice)),
        "a claim names its claimer: devbox.io/owner-name must be mallory",
    )
    _refused(
        _kubectl(mallory, "label", "--overwrite", "pod", warm, "devbox.io/profile=gpu"),
        "only the autoscaler",
    )
    _refused(_kubectl(mallory, "delete", "pod", warm, "--wait=false"), "only the autoscaler")
    # Claiming it for herself is allowed, but not with another image in the same patch:
    # the container is root until its agent becomes the owner, with every home mounted.
    own_claim = {
        "metadata": {
            "resourceVersion": version,
            "labels": {"devbox.io/state": "claimed", "devbox.io/box": "x",
                       "devbox.io/owner": owner_label("mallory")},
            "annotations": {"devbox.io/owner-name": "mallory", "devbox.io/owner-key": mine},
        },
        "spec": {"containers": [{"name": "box", "image": "evil/box:latest"}]},
    }  # fmt: skip
    _refused(
        _kubectl(mallory, "patch", "pod", warm, "--type=strategic", "-p", json.dumps(own_claim)),
        "a box pod's spec does not change once it is made",
    )
    assert _pod(admin, warm)["metadata"]["labels"]["devbox.io/state"] == "warm"
    # alice claims it, through devbox, and from then on it is hers alone.
    done = alice.devbox("up", "aw", "--no-attach", "--json", timeout=120)
    assert done.returncode == 0 and b"claimed warm pod" in done.stderr, done.stderr
    assert json.loads(done.stdout)["place"] == warm
    _refused(_kubectl(mallory, "delete", "pod", warm, "--wait=false"), "belongs to alice")


@contextmanager
def _port_forward(kube: KubeUser, pod: str) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            str(kube.cluster.kubectl),
            "--kubeconfig",
            kube.user.env["KUBECONFIG"],
            "-n",
            kube.namespace,
            "port-forward",
            f"pod/{pod}",
            f"{port}:2222",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert b"Forwarding from" in proc.stdout.readline(), (
            proc.stderr.read() if proc.stderr else b""
        )
        yield port
    finally:
        proc.kill()
        proc.wait()


def _ssh_with(kube: KubeUser, port: int, key: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [
            "ssh",
            "-F",
            "none",
            "-i",
            str(key),
            "-p",
            str(port),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "alice@127.0.0.1",
            "true",
        ],
        capture_output=True,
        timeout=60,
        env=kube.user.env,
    )


def test_mallorys_key_gets_no_shell_even_after_a_changed_annotation(lab: Person) -> None:
    alice, mallory = lab("alice"), lab("mallory")
    admin = lab("admin", admin=True)
    _up(alice, "a1")
    _up(mallory, "m1")
    key = mallory.user.home / ".config/devbox/id_ed25519"
    with _port_forward(mallory, "devbox-a1") as port:  # the port-forward RBAC allows her
        denied = _ssh_with(mallory, port, key)
        assert denied.returncode == 255 and b"Permission denied" in denied.stderr, denied.stderr
        # Whoever gets past the policy (here a cluster administrator) and writes her key
        # on alice's pod: the agent keeps the key it saw at the claim, and says so.
        _kubectl(
            admin,
            "annotate",
            "--overwrite",
            "pod",
            "devbox-a1",
            f"devbox.io/owner-key={_user_key(mallory)}",
        )

        def reported() -> bool:
            got = _kubectl(
                admin,
                "get",
                "events",
                "--field-selector",
                "involvedObject.name=devbox-a1,reason=OwnerKeyChangeRefused",
                "-o",
                "name",
            )
            return bool(got.stdout.strip())

        wait_until(reported, timeout=30, what="the agent's OwnerKeyChangeRefused event")
        denied = _ssh_with(mallory, port, key)
        assert denied.returncode == 255 and b"Permission denied" in denied.stderr, denied.stderr
    assert (
        alice.devbox("ssh", "a1", "--", "echo", "still-mine", check=True).stdout == b"still-mine\n"
    )


def _agent_kubeconfig(kube: KubeUser, admin: KubeUser, pod: str, folder: Path) -> Path:
    """The credentials a box's agent holds: the devbox-agent token bound to its pod."""
    uid = _pod(admin, pod)["metadata"]["uid"]
    made = _kubectl(
        admin,
        "create",
        "token",
        "devbox-agent",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        pod,
        "--bound-object-uid",
        uid,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.decode().strip()
    return token_kubeconfig(kube.cluster, token, folder / "agent-kubeconfig")


def test_an_agents_token_touches_only_its_own_pod(lab: Person, tmp_path: Path) -> None:
    alice, admin = lab("alice"), lab("admin", admin=True)
    _up(alice, "a1")
    _up(alice, "a2")
    agent = KubeUser(alice.user, alice.namespace, alice.cluster)
    agent_kc = _agent_kubeconfig(alice, admin, "devbox-a1", tmp_path)
    agent.user.env = dict(alice.user.env, KUBECONFIG=str(agent_kc))
    # What it is for: its own pod's agent annotations, its own Lease.
    ok = _kubectl(agent, "annotate", "--overwrite", "pod", "devbox-a1", "devbox.io/alerts=")
    assert ok.returncode == 0, ok.stderr
    _refused(
        _kubectl(agent, "annotate", "--overwrite", "pod", "devbox-a1", "devbox.io/owner-key=x"),
        "only its own annotations",
    )
    _refused(
        _kubectl(agent, "label", "--overwrite", "pod", "devbox-a1", "devbox.io/box=zz"),
        "only its own annotations",
    )
    _refused(
        _kubectl(agent, "set", "image", "pod/devbox-a1", "box=evil:latest"),
        "only its own annotations",
    )
    _refused(
        _kubectl(agent, "annotate", "--overwrite", "pod", "devbox-a2", "devbox.io/alerts="),
        "may change only its own pod",
    )
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "devbox-a2"},
        "spec": {"holderIdentity": "devbox-a1"},
    }
    _refused(
        _kubectl(agent, "apply", "-f", "-", input=json.dumps(lease).encode()),
        "only its own pod's Lease",
    )
    lease["metadata"]["name"] = "devbox-a1"  # type: ignore[index]
    ok = _kubectl(
        agent,
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        "-",
        input=json.dumps(lease).encode(),
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(
    "names",
    [("jürgen", "jörgen"), ("王伟", "李娜"), ("x" * 63 + "a", "x" * 63 + "b")],
    ids=["umlauts", "cjk", "long"],
)
def test_names_that_once_collided_stay_apart(lab: Person, names: tuple[str, str]) -> None:
    one, two = lab(names[0]), lab(names[1])
    _up(one, "b1")
    _up(two, "b2")
    labels = {
        _pod(one, f"devbox-{b}")["metadata"]["labels"]["devbox.io/owner"] for b in ("b1", "b2")
    }
    assert labels == {owner_label(names[0]), owner_label(names[1])} and len(labels) == 2
    for kube, own, other in ((one, "b1", "b2"), (two, "b2", "b1")):
        listed = json.loads(kube.devbox("ls", "--json", check=True).stdout)
        assert [(b["name"], b["owner"]) for b in listed] == [(own, names[(kube is two) * 1])]
        assert "belongs to" in _one_line(kube.devbox("down", other))


def test_nobody_enters_a_box_but_through_its_agent(lab: Person) -> None:
    """Even with RBAC too generous (exec, attach, ephemeral containers granted), the
    policy keeps everyone but the autoscaler out of a box's root-owned container, and
    keeps its spec (image) as it was made, for its owner too."""
    mallory = lab("mallory")
    _up(mallory, "m1")
    generous = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "too-generous"},
        "rules": [{"apiGroups": [""], "verbs": ["create", "get", "patch", "update"],
                   "resources": ["pods/exec", "pods/attach", "pods/ephemeralcontainers"]}],
    }  # fmt: skip
    admin = lab("admin", admin=True)
    made = _kubectl(admin, "apply", "-f", "-", input=json.dumps(generous).encode())
    assert made.returncode == 0, made.stderr
    bound = _kubectl(admin, "create", "rolebinding", "too-generous", "--role", "too-generous",
                     "--user", "mallory")  # fmt: skip
    assert bound.returncode == 0, bound.stderr
    why = "entered through their agent"
    _refused(_kubectl(mallory, "exec", "devbox-m1", "--", "id"), why)
    _refused(_kubectl(mallory, "attach", "devbox-m1"), why)
    _refused(_kubectl(mallory, "debug", "devbox-m1", "--image=devbox/box:test", "--", "true"), why)
    _refused(
        _kubectl(mallory, "set", "image", "pod/devbox-m1", "box=evil/box:latest"),
        "a box pod's spec does not change once it is made",
    )
    assert _pod(admin, "devbox-m1")["spec"]["containers"][0]["image"] == "devbox/box:test"
