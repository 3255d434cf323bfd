"""Kubernetes boxes on the test cluster's real node (kubelet + containerd + runc), where a
claim starts a real container and the SSH stream goes through the kubelet's port-forward
(tests/cluster/realnode/; needs root, as scripts/test runs).

1. Claim to a shell prompt: `devbox up NAME --profile real` on a terminal, attaching in
   the same process, to a typed-ahead command having run in the box's shell; cold (a new
   pod: schedule, sandbox, container, agent start) and warm (a pod of the warm pool,
   claimed with one PATCH). Targets: warm < 1 s, warm <= 0.3x cold.
2. Throughput to the same box: devbox's path (ssh through `devbox proxy`) vs `kubectl
   port-forward` with the same ssh client, MiB/s of a download from its first byte to its
   last, the best of 5 per path, the paths taking turns (target >= 1.0x).

Uses the shared test cluster when it is up with its real node (scripts/test-cluster up
--real-node); otherwise starts it, and takes it down again at the end.

    sudo python benchmarks/bench_real_node.py [--runs 5] [--mib 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

from benchmarks.harness import (
    REPO,
    Sandbox,
    devbox_command,
    emit,
    free_port,
    sandbox,
    ssh_base,
    summary,
)
from benchmarks.k8s_common import (
    claim_to_shell,
    cluster_bin,
    configure_kube_user,
    downloads,
    kubectl_forward,
)

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
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_real_node: the real test node needs root")
    devbox = devbox_command()
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
            result = measure(sb, devbox, k, ns, runs=args.runs, mib=args.mib)
        finally:
            subprocess.run([*k, "delete", "namespace", ns, "--wait=false"], capture_output=True)
    emit(result)


def measure(
    sb: Sandbox, devbox: list[str], k: list[str], ns: str, *, runs: int, mib: int
) -> dict[str, object]:
    # The first pod of a namespace also makes its homes claim: not part of a claim's cost.
    sb.devbox("up", "warmup", "--profile", "real", "--no-attach")
    sb.devbox("down", "warmup")
    cold, warm = [], []
    for i in range(runs):
        cold.append(claim_to_shell([*devbox, "up", f"cold{i}", "--profile", "real"], sb.env))
        sb.devbox("down", f"cold{i}")
        sb.devbox("pool", "warm", "--profile", "real", "--size", "1")  # waits until it serves
        warm.append(claim_to_shell([*devbox, "up", f"warm{i}", "--profile", "real"], sb.env))
        sb.devbox("down", f"warm{i}")

    box = json.loads(sb.devbox("up", "tput", "--profile", "real", "--no-attach", "--json").stdout)
    sb.devbox("ssh-config", "--write")
    ours = ["ssh", "-F", str(Path(sb.env["HOME"]) / ".config/devbox/ssh_config"), "tput.devbox"]
    port = free_port()
    with kubectl_forward(k, ns, box["place"], port):
        known = Path(sb.env["HOME"]) / ".local/state/devbox/known_hosts"
        theirs = ssh_base(sb.key, known, port, alias="tput.devbox")
        devbox_mbps, kubectl_mbps = downloads([ours, theirs], sb.env, mib, 5)
    sb.devbox("down", "tput")
    warm_over_cold = summary(warm)["median"] / summary(cold)["median"]
    return {
        "benchmark": "kubernetes_real_node",
        "runs": runs,
        "claim_to_shell": {
            "cold_s": summary(cold),
            "warm_s": summary(warm),
            "warm_over_cold": warm_over_cold,
        },
        "throughput_MiBps": {
            "devbox_port_forward": devbox_mbps,
            "kubectl_port_forward": kubectl_mbps,
        },
        "throughput_ratio": devbox_mbps / kubectl_mbps,
        "targets": {
            "warm_claim_to_shell_median_s": 1.0,
            "warm_over_cold": 0.3,
            "throughput_ratio": 1.0,
        },
        "met": {
            "warm_claim_to_shell_median_s": summary(warm)["median"] < 1.0,
            "warm_over_cold": warm_over_cold <= 0.3,
            "throughput_ratio": devbox_mbps / kubectl_mbps >= 1.0,
        },
    }


if __name__ == "__main__":
    main()
