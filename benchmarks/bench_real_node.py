"""Kubernetes boxes on the test cluster's real node (kubelet + containerd + runc), where a
claim starts a real container and the SSH stream goes through the kubelet's port-forward
(tests/cluster/realnode/; needs root, as scripts/test runs). The figures are
k8s_common.measure's, as bench_k8s's on kwok:

1. A warm claim to a shell prompt (issue 22: <= 0.25 s; a pod of the warm pool, claimed
   with one PATCH): `devbox up NAME --profile real` on a terminal, attaching in the same
   process, to a typed-ahead command having run in the box's shell; devbox installed,
   bytecode cached and compiled each run, interleaved with the raw peer doing the same
   requests (and with --baseline, an earlier checkout).
2. Cold (a new pod: schedule, sandbox, container, agent start) in the same rounds; target
   warm <= 0.3x cold.
3. Throughput to the same box: devbox's path (ssh through `devbox proxy`) vs `kubectl
   port-forward` with the same ssh client, MiB/s of a download from its first byte to its
   last, the best of 5 per path, the paths taking turns (target >= 1.0x).

Uses the shared test cluster when it is up with its real node (scripts/test-cluster up
--real-node); otherwise starts it, and takes it down again at the end.

    sudo python benchmarks/bench_real_node.py [--runs 6] [--mib 64] [--warm-only] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import REPO, emit, sandbox
from benchmarks.k8s_common import cluster_bin, configure_kube_user, measure

PROFILE = """
[profiles.real]
cpu = "100m"
memory = "256Mi"
node_selector = { "devbox-test/node" = "real" }
tolerations = [{ key = "devbox-test/real-node", operator = "Exists", effect = "NoSchedule" }]
"""


@contextlib.contextmanager
def real_node_cluster() -> Iterator[tuple[Path, Path]]:
    """(kubeconfig, kubectl) of the shared test cluster with its real node."""
    script = str(REPO / "scripts/test-cluster")
    env = dict(os.environ, PYTHON=sys.executable)
    status = subprocess.run([script, "status"], env=env, capture_output=True, text=True)
    was_up = status.returncode == 0 and "real node: up" in status.stdout
    subprocess.run([script, "up", "--real-node"], env=env, check=True, stdout=subprocess.DEVNULL)
    folder = Path(os.environ.get("DEVBOX_TEST_CLUSTER_DIR", "/tmp/devbox-test-cluster"))
    bin_dir = cluster_bin()
    try:
        yield folder / "kubeconfig", bin_dir / "kubectl"
    finally:
        if not was_up:
            subprocess.run([script, "down"], env=env, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--warm-only", action="store_true", help="no cold claims, no throughput")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier devbox (git archive): its warm claims in the same rounds",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_real_node: the real test node needs root")
    with real_node_cluster() as (kubeconfig, kubectl), sandbox() as sb:
        k = [str(kubectl), "--kubeconfig", str(kubeconfig)]
        ns = f"bench-real-{os.getpid()}"
        subprocess.run([*k, "create", "namespace", ns], check=True, capture_output=True)
        try:
            subprocess.run(
                [*k, "apply", "-n", ns, "-f", str(REPO / "images/k8s/agent-rbac.yaml")],
                check=True,
                capture_output=True,
            )
            configure_kube_user(sb, kubeconfig, ns, image="devbox/box:test", extra=PROFILE)
            result = measure(
                sb,
                kubeconfig=kubeconfig,
                kubectl=k,
                namespace=ns,
                profile="real",
                runs=args.runs,
                mib=args.mib,
                warm_only=args.warm_only,
                baseline=args.baseline,
            )
        finally:
            subprocess.run([*k, "delete", "namespace", ns, "--wait=false"], capture_output=True)
    emit({"benchmark": "kubernetes_real_node", **result})


if __name__ == "__main__":
    main()
