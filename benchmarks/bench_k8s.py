"""Kubernetes backend on the simulated cluster (scripts/test-cluster, a private one); the
figures are k8s_common.measure's, as bench_real_node's on the real node.

1. A warm claim to a shell prompt (issue 22: <= 0.25 s): `devbox up NAME` on a terminal,
   attaching in the same process as a user runs it, to a typed-ahead command having run
   in the box's shell. devbox in three start-up modes: `installed` (as `pip install .`
   leaves it: bytecode cached, no editable hook), `bytecode_cached` (this editable
   checkout, bytecode cached) and `devbox_compiled_each_run` (PYTHONDONTWRITEBYTECODE=1:
   devbox's modules compiled by every run, as on this machine); each take interleaved,
   round by round, with its peer's: the same requests from a minimal Python client
   (benchmarks/k8s_raw_claim.py), the floor for a Python client; with --baseline, an
   earlier checkout's devbox in the same rounds. Also the client's CPU seconds (it and
   its ssh), which the machine's load does not change.
2. A cold claim (a new pod) the same way, in the same rounds (target: warm <= 0.3x cold).
3. Throughput to the same agent: devbox's path (ssh through `devbox proxy`) vs `kubectl
   port-forward` (built from the same Kubernetes module) with the same ssh client
   (target >= 1.0x): MiB/s from a download's first byte to its last, the best of 5 per
   path, the paths taking turns.
    python benchmarks/bench_k8s.py [--runs 8] [--mib 64] [--warm-only] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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

from benchmarks.harness import REPO, emit, sandbox
from benchmarks.k8s_common import cluster_bin, configure_kube_user, measure


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
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier devbox (git archive): its warm claims in the same rounds",
    )
    args = parser.parse_args()
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
        result = measure(
            sb,
            kubeconfig=kubeconfig,
            kubectl=k,
            namespace=ns,
            profile="default",
            runs=args.runs,
            mib=args.mib,
            warm_only=args.warm_only,
            baseline=args.baseline,
        )
    emit({"benchmark": "kubernetes", **result})


if __name__ == "__main__":
    main()
