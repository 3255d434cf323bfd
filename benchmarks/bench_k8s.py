"""Kubernetes backend on the simulated cluster (scripts/test-cluster, a private one).

1. Claim to a shell prompt, from the warm pool vs a cold pod create (targets: warm <=
   0.3x cold, warm median < 1 s): `devbox up NAME` on a terminal, attaching in the same
   process as a user runs it, to a typed-ahead command having run in the box's shell.
   Also, for the breakdown, the two-command way: `devbox up NAME --no-attach` then
   `devbox ssh NAME -- true`.
2. Throughput to the same agent: devbox's path (ssh through `devbox proxy`, the official
   client's port-forward) vs `kubectl port-forward` (built from the same Kubernetes
   module) with the same ssh client (target >= 1.0x): MiB/s from a download's first byte
   to its last, the best of 5 per path, the paths taking turns.
    python benchmarks/bench_k8s.py [--runs 6] [--mib 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import (
    REPO,
    devbox_command,
    emit,
    free_port,
    sandbox,
    ssh_base,
    summary,
    wall,
)
from benchmarks.k8s_common import (
    claim_to_shell,
    cluster_bin,
    configure_kube_user,
    downloads,
    kubectl_forward,
)


@contextlib.contextmanager
def private_cluster() -> Iterator[tuple[Path, Path]]:
    folder = Path(tempfile.mkdtemp(prefix="dbxb", dir="/tmp")) / "cluster"
    env = dict(os.environ, DEVBOX_TEST_CLUSTER_DIR=str(folder), PYTHON=sys.executable)
    subprocess.run(
        [str(REPO / "scripts/test-cluster"), "up"], env=env, check=True, stdout=subprocess.DEVNULL
    )
    bin_dir = cluster_bin()
    try:
        yield folder / "kubeconfig", bin_dir / "kubectl"
    finally:
        subprocess.run(
            [str(REPO / "scripts/test-cluster"), "down"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(folder.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    devbox = devbox_command()
    with private_cluster() as (kubeconfig, kubectl), sandbox() as sb:
        ns = "bench"
        k = [str(kubectl), "--kubeconfig", str(kubeconfig)]
        subprocess.run([*k, "create", "namespace", ns], check=True, capture_output=True)
        subprocess.run(
            [
                *k,
                "apply",
                "-n",
                ns,
                "-f",
                str(REPO / "images/k8s/agent-rbac.yaml"),
                "-f",
                str(REPO / "images/k8s/cluster.yaml"),
            ],
            check=True,
            capture_output=True,
        )
        configure_kube_user(sb, kubeconfig, ns, image="devbox/box:bench")
        sb.devbox("up", "warmup", "--no-attach")
        sb.devbox("down", "warmup")

        cold_up, cold_ssh, warm_up, warm_ssh = [], [], [], []
        for i in range(args.runs):
            cold_up.append(wall([*devbox, "up", f"cold{i}", "--no-attach"], sb.env))
            cold_ssh.append(wall([*devbox, "ssh", f"cold{i}", "--", "true"], sb.env))
            sb.devbox("pool", "warm", "--size", "1")  # waits until the warm pod serves
            warm_up.append(wall([*devbox, "up", f"warm{i}", "--no-attach"], sb.env))
            warm_ssh.append(wall([*devbox, "ssh", f"warm{i}", "--", "true"], sb.env))
        cold = [a + b for a, b in zip(cold_up, cold_ssh, strict=True)]
        warm = [a + b for a, b in zip(warm_up, warm_ssh, strict=True)]
        # The same, as a user does it: one `devbox up` on a terminal, attaching itself.
        cold_tty, warm_tty = [], []
        for i in range(args.runs):
            cold_tty.append(claim_to_shell([*devbox, "up", f"tcold{i}"], sb.env))
            sb.devbox("pool", "warm", "--size", "1")
            warm_tty.append(claim_to_shell([*devbox, "up", f"twarm{i}"], sb.env))

        # Throughput: both paths end at the same agent and use the same OpenSSH client.
        box = json.loads(sb.devbox("up", "tput", "--no-attach", "--json").stdout)
        sb.devbox("ssh-config", "--write")
        ours = ["ssh", "-F", str(Path(sb.env["HOME"]) / ".config/devbox/ssh_config"), "tput.devbox"]
        port = free_port()
        with kubectl_forward(k, ns, box["place"], port):
            known = Path(sb.env["HOME"]) / ".local/state/devbox/known_hosts"
            theirs = ssh_base(sb.key, known, port, alias="tput.devbox")
            devbox_mbps, kubectl_mbps = downloads([ours, theirs], sb.env, args.mib, 5)
    warm_over_cold = summary(warm_tty)["median"] / summary(cold_tty)["median"]
    emit(
        {
            "benchmark": "kubernetes",
            "runs": args.runs,
            # Claim to a shell prompt, as a user gets one: `devbox up NAME` on a terminal.
            "claim_to_shell": {
                "cold_s": summary(cold_tty),
                "warm_s": summary(warm_tty),
                "warm_over_cold": warm_over_cold,
            },
            # The same in two commands, `up --no-attach` then `ssh -- true`: each pays its
            # own Python start and box look-up, the same in both columns.
            "two_commands": {
                "cold_up_s": summary(cold_up),
                "cold_first_ssh_s": summary(cold_ssh),
                "cold_total_s": summary(cold),
                "warm_up_s": summary(warm_up),
                "warm_first_ssh_s": summary(warm_ssh),
                "warm_total_s": summary(warm),
                "warm_over_cold": summary(warm)["median"] / summary(cold)["median"],
            },
            "targets": {
                "warm_over_cold": 0.3,
                "warm_claim_to_shell_median_s": 1.0,
                "throughput_ratio": 1.0,
            },
            "met": {
                "warm_over_cold": warm_over_cold <= 0.3,
                "warm_claim_to_shell_median_s": summary(warm_tty)["median"] < 1.0,
                "throughput_ratio": devbox_mbps / kubectl_mbps >= 1.0,
            },
            "throughput_MiBps": {
                "devbox_port_forward": devbox_mbps,
                "kubectl_port_forward": kubectl_mbps,
            },
            "throughput_ratio": devbox_mbps / kubectl_mbps,
        }
    )


if __name__ == "__main__":
    main()
