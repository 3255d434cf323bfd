"""Fixtures for tests against the real control plane (scripts/test-cluster): a namespace
per test with the agent's RBAC applied by kubectl, and a devbox user pointed at it."""

from __future__ import annotations

import base64
import datetime
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.conftest import REPO, User, make_user

CLUSTER_DIR = Path(os.environ.get("DEVBOX_TEST_CLUSTER_DIR", "/tmp/devbox-test-cluster"))


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path
    restricted: Path
    kubectl: Path

    def kubectl_run(
        self, *args: str, kubeconfig: Path | None = None, input: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [str(self.kubectl), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
            input=input,
            capture_output=True,
            timeout=120,
            check=False,
        )


def start_cluster(folder: Path | None = None) -> Cluster:
    """`scripts/test-cluster up` (a no-op when up; it serialises concurrent calls itself)."""
    env = dict(os.environ)
    if folder is not None:
        env["DEVBOX_TEST_CLUSTER_DIR"] = str(folder)
    up = subprocess.run(
        [str(REPO / "scripts/test-cluster"), "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if up.returncode != 0:
        raise RuntimeError(f"scripts/test-cluster up failed:\n{up.stderr[-3000:]}")
    bin_dir = (
        subprocess.run(
            [str(REPO / "tests/cluster/build.sh")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    where = folder or CLUSTER_DIR
    made = Cluster(where / "kubeconfig", where / "kubeconfig-restricted", Path(bin_dir) / "kubectl")
    # The administrator's one-time objects, as images/k8s documents them.
    for objects in ("cluster.yaml", "policies.yaml"):
        applied = made.kubectl_run("apply", "-f", str(REPO / "images/k8s" / objects))
        assert applied.returncode == 0, applied.stderr
    return made


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The shared test control plane, started once for all xdist workers."""
    return start_cluster()


@pytest.fixture
def private_cluster(cluster: Cluster) -> Iterator[Cluster]:
    """A control plane of the test's own, for tests that fill it or restart it.

    One at a time (a lock across xdist workers): two kwokctl clusters starting at the
    same moment can pick the same free port for a component."""
    lock = open("/tmp/devbox-private-cluster.lock", "w")  # noqa: SIM115 (held until teardown)
    fcntl.flock(lock, fcntl.LOCK_EX)
    folder = Path(tempfile.mkdtemp(prefix="dbxp", dir="/tmp")) / "cluster"
    try:
        yield start_cluster(folder)
    finally:
        stop_cluster(folder)
        lock.close()


def stop_cluster(folder: Path) -> None:
    """`scripts/test-cluster down` for a cluster started in `folder`, and the folder gone."""
    subprocess.run(
        [str(REPO / "scripts/test-cluster"), "down"],
        env=dict(os.environ, DEVBOX_TEST_CLUSTER_DIR=str(folder)),
        capture_output=True,
        timeout=120,
        check=False,
    )
    shutil.rmtree(folder.parent, ignore_errors=True)


@dataclass
class KubeUser:
    user: User
    namespace: str
    cluster: Cluster

    def devbox(self, *args: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
        return self.user.devbox(*args, **kw)  # type: ignore[arg-type]


def new_namespace(cluster: Cluster, *, agent_rbac: bool = True) -> str:
    ns = f"t-{secrets.token_hex(4)}"
    created = cluster.kubectl_run("create", "namespace", ns)
    assert created.returncode == 0, created.stderr
    # Every test namespace is as the README tells an administrator to make one: the
    # admission policies apply (those who act as cluster admins are not checked).
    labelled = cluster.kubectl_run("label", "namespace", ns, "devbox.io/policy=enforce")
    assert labelled.returncode == 0, labelled.stderr
    if agent_rbac:
        applied = cluster.kubectl_run(
            "apply", "-n", ns, "-f", str(REPO / "images/k8s/agent-rbac.yaml")
        )
        assert applied.returncode == 0, applied.stderr
    return ns


LAB = "devbox-lab"  # the group every lab member's certificate names


def lab_namespace(cluster: Cluster) -> str:
    """A namespace as the README sets one up: the user Role bound to the lab's group."""
    ns = new_namespace(cluster)
    role = cluster.kubectl_run("apply", "-n", ns, "-f", str(REPO / "images/k8s/user-role.yaml"))
    assert role.returncode == 0, role.stderr
    bound = cluster.kubectl_run(
        "create", "rolebinding", "devbox-users", "-n", ns, "--role", "devbox-user", "--group", LAB
    )
    assert bound.returncode == 0, bound.stderr
    # The autoscaler is installed here too: its account is one a user might try to use.
    account = cluster.kubectl_run("create", "serviceaccount", "devbox-autoscaler", "-n", ns)
    assert account.returncode == 0, account.stderr
    return ns


def identity_kubeconfig(cluster: Cluster, folder: Path, username: str, group: str) -> Path:
    """A kubeconfig whose client certificate (signed by the test cluster's CA) makes the
    API server authenticate `username` in `group`: a distinct Kubernetes user."""
    pki = next((cluster.kubeconfig.parent / "kwok/clusters").glob("*/pki"))
    with warnings.catch_warnings():  # kwokctl's CA has a serial RFC 5280 frowns upon
        warnings.simplefilter("ignore")
        ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, group),
            x509.NameAttribute(NameOID.COMMON_NAME, username),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    credentials = {
        "client-certificate-data": base64.b64encode(pem).decode(),
        "client-key-data": base64.b64encode(key_pem).decode(),
    }
    return kubeconfig_of(cluster, credentials, folder / "kubeconfig")


def token_kubeconfig(cluster: Cluster, token: str, path: Path) -> Path:
    """A kubeconfig that presents `token` (a service account's, say) and nothing else."""
    return kubeconfig_of(cluster, {"token": token}, path)


def kubeconfig_of(cluster: Cluster, credentials: dict[str, str], path: Path) -> Path:
    """The test cluster's API server, reached with `credentials` only (no admin cert)."""
    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": server}],
        "users": [{"name": "me", "user": credentials}],
        "contexts": [{"name": "me", "context": {"cluster": "test", "user": "me"}}],
        "current-context": "me",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def configure(user: User, namespace: str, kubeconfig: Path) -> None:
    user.env["KUBECONFIG"] = str(kubeconfig)
    config = user.home / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        'backend = "kubernetes"\n'
        f'namespace = "{namespace}"\n'
        'home_storage_class = "devbox-sim"\n'
        'image = "devbox/box:test"\n'
        "start_timeout = 120\n"
    )


def kube_user(cluster: Cluster, folder: Path, nvml_lib_dir: Path) -> KubeUser:
    ns = new_namespace(cluster)
    user = make_user(folder, nvml_lib_dir)
    configure(user, ns, cluster.kubeconfig)
    return KubeUser(user, ns, cluster)


@pytest.fixture
def kube(cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path) -> Iterator[KubeUser]:
    made = kube_user(cluster, tmp_path / "k", nvml_lib_dir)
    yield made
    cluster.kubectl_run("delete", "namespace", made.namespace, "--wait=false")
    made.user.stop_all()


@dataclass(frozen=True)
class Node:
    """A simulated GPU node of one test's own: tainted, so that only pods tolerating
    `taint` (key, value; NoSchedule) land on it, whatever else runs in the cluster."""

    name: str
    gpus: int
    taint: tuple[str, str]


@pytest.fixture
def own_node(kube: KubeUser) -> Iterator[Node]:
    node = Node(name=f"gpu-{kube.namespace}", gpus=2, taint=("devbox.io/test", kube.namespace))
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            # As scripts/test-cluster's nodes: kwok manages it and keeps this status.
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/os": "linux",
                "kubernetes.io/hostname": node.name,
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {
            "taints": [{"key": node.taint[0], "value": node.taint[1], "effect": "NoSchedule"}]
        },
        "status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "2"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "2"},
        },
    }
    made = kube.cluster.kubectl_run("apply", "-f", "-", input=json.dumps(body).encode())
    assert made.returncode == 0, made.stderr
    try:
        ready = kube.cluster.kubectl_run(
            "wait", "--for=condition=Ready", f"node/{node.name}", "--timeout=120s"
        )
        assert ready.returncode == 0, ready.stderr
        yield node
    finally:
        kube.cluster.kubectl_run("delete", "node", node.name, "--wait=false")


def set_profiles(kube: KubeUser, text: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "devbox-profiles", "namespace": kube.namespace},
        "data": {"profiles.toml": text},
    }
    done = kube.cluster.kubectl_run("apply", "-f", "-", input=json.dumps(body).encode())
    assert done.returncode == 0, done.stderr


def pinned(node: Node) -> str:
    """A profile of one GPU on `node` (selected by hostname, tolerating its taint)."""
    key, value = node.taint
    return f"""
[profiles.pinned]
gpus = 1
cpu = "250m"
memory = "300Mi"
node_selector = {{ "kubernetes.io/hostname" = "{node.name}" }}
tolerations = [{{ key = "{key}", operator = "Equal", value = "{value}", effect = "NoSchedule" }}]
"""
