"""Kubernetes backend on the simulated cluster (scripts/test-cluster, a private one).

1. A warm claim to a shell prompt (issue 22: <= 0.25 s): `devbox up NAME` on a terminal,
   attaching in the same process as a user runs it, to a typed-ahead command having run
   in the box's shell; in both bytecode modes (k8s_common.bytecode_modes), each take
   interleaved with its peer's: the same requests from a minimal Python client
   (benchmarks/k8s_raw_claim.py), the floor for a Python client.
2. A cold claim (a new pod) the same way, in the same rounds (target: warm <= 0.3x cold).
3. Throughput to the same agent: devbox's path (ssh through `devbox proxy`) vs `kubectl
   port-forward` (built from the same Kubernetes module) with the same ssh client
   (target >= 1.0x): MiB/s from a download's first byte to its last, the best of 5 per
   path, the paths taking turns.
    python benchmarks/bench_k8s.py [--runs 8] [--mib 64] [--warm-only]
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
    interleaved,
    machine,
    met,
    sandbox,
    ssh_base,
    summary,
)
from benchmarks.k8s_common import (
    CACHED,
    COMPILED,
    bytecode_modes,
    claim_to_shell,
    cluster_bin,
    configure_kube_user,
    downloads,
    kubectl_forward,
    raw_claim_spec,
    warm_claims,
)

TARGET_S = 0.25  # issue 22: a warm claim to a shell prompt


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
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--warm-only", action="store_true", help="no cold claims, no throughput")
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
        # The namespace's first pod makes the homes claim; the first command caches who
        # the user is (the SelfSubjectReview): neither is part of a claim's cost.
        sb.devbox("up", "warmup", "--no-attach")
        sb.devbox("down", "warmup", "--now")
        raw = raw_claim_spec(sb, kubeconfig, ns, profile="default")

        def warm_up(env: dict[str, str]) -> None:
            sb.devbox("pool", "warm", "--size", "1")
            claim_to_shell([*devbox, "up", "bytecode"], env)
            sb.devbox("down", "bytecode", "--now")

        modes = bytecode_modes(sb.env, sb.root, warm_up)
        takes = warm_claims(sb, modes, raw, profile=[], tag="w")
        colds = iter(range(1_000_000))

        def cold() -> float:
            # The takes before it left the pool empty: this one makes a pod.
            name = f"cold{next(colds)}"
            took = claim_to_shell([*devbox, "up", name], modes[CACHED])
            assert not str(sb.box(name)["place"]).startswith("devbox-warm-"), "not a cold claim"
            sb.devbox("down", name, "--now")
            return took

        if not args.warm_only:
            takes["cold"] = cold
        interleaved(1, takes)  # a first round of each, not counted
        samples = interleaved(args.runs, takes)
        result: dict[str, object] = {
            "benchmark": "kubernetes",
            "machine": machine(),
            "runs": args.runs,
            "claim_to_shell_s": {name: summary(s) for name, s in samples.items()},
        }
        median = {name: float(summary(s)["median"]) for name, s in samples.items()}
        result["devbox_over_raw_peer"] = {
            mode: median[mode] / median["raw_peer"] for mode in (CACHED, COMPILED)
        }
        targets = {
            f"warm_claim_to_shell_{mode}_median_s": met(median[mode], "<=", TARGET_S)
            for mode in (CACHED, COMPILED)
        }
        if not args.warm_only:
            result["warm_over_cold"] = median[CACHED] / median["cold"]
            targets["warm_over_cold"] = met(median[CACHED] / median["cold"], "<=", 0.3)
            # Throughput: both paths end at the same agent and use the same OpenSSH client.
            box = json.loads(sb.devbox("up", "tput", "--no-attach", "--json").stdout)
            sb.devbox("ssh-config", "--write")
            home = Path(sb.env["HOME"])
            ours = ["ssh", "-F", str(home / ".config/devbox/ssh_config"), "tput.devbox"]
            port = free_port()
            with kubectl_forward(k, ns, box["place"], port):
                known = home / ".local/state/devbox/known_hosts"
                theirs = ssh_base(sb.key, known, port, alias="tput.devbox")
                env = modes[CACHED]
                devbox_mbps, kubectl_mbps = downloads([ours, theirs], env, args.mib, 5)
            result["throughput_MiBps"] = {
                "devbox_port_forward": devbox_mbps,
                "kubectl_port_forward": kubectl_mbps,
            }
            result["throughput_ratio"] = devbox_mbps / kubectl_mbps
            targets["throughput_ratio"] = met(devbox_mbps / kubectl_mbps, ">=", 1.0)
        result["met"] = targets
    emit(result)


if __name__ == "__main__":
    main()
