"""Fixtures for tests against the real control plane (scripts/test-cluster): a namespace
per test with the agent's RBAC applied by kubectl, and a devbox user pointed at it."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The test control plane, started once for all xdist workers (up is idempotent)."""
    # The script serialises concurrent `up`s itself (a flock) and is a no-op when up.
    up = subprocess.run(
        [str(REPO / "scripts/test-cluster"), "up"],
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
    return Cluster(
        CLUSTER_DIR / "kubeconfig", CLUSTER_DIR / "kubeconfig-restricted", Path(bin_dir) / "kubectl"
    )


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
    if agent_rbac:
        applied = cluster.kubectl_run(
            "apply", "-n", ns, "-f", str(REPO / "images/k8s/agent-rbac.yaml")
        )
        assert applied.returncode == 0, applied.stderr
    return ns


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


@pytest.fixture
def kube(cluster: Cluster, tmp_path: Path, nvml_lib_dir: Path) -> Iterator[KubeUser]:
    ns = new_namespace(cluster)
    user = make_user(tmp_path / "k", nvml_lib_dir)
    configure(user, ns, cluster.kubeconfig)
    yield KubeUser(user, ns, cluster)
    cluster.kubectl_run("delete", "namespace", ns, "--wait=false")
