"""Several clusters against one, in the same run (kwok control planes from scripts/test-cluster).

1. Warm claim to a shell prompt: `devbox up NAME` on a terminal, attaching in the same
   process, to a typed-ahead command having run in the box's shell, with a warm pod
   ready in the most preferred cluster. One cluster (no [clusters] in the config) against
   three configured (the claim reads all three in parallel). Target: at most 100 ms more.
   The two take turns, so drift on the machine falls on both alike.
2. `devbox ls` with one cluster, with three, and with three of which one is down
   (connection refused) and one is hung (its API server stopped with SIGSTOP: it accepts
   connections and never answers), where the clusters are this benchmark's own.

    python benchmarks/bench_clusters.py [--runs 5] [--kubeconfigs A B C]

Without --kubeconfigs it starts three control planes of its own (a minute or two).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

if not __package__:
    # Run as a file (see bench_k8s.py): the repo's root on the path, as under `python -m`.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import yaml

from benchmarks.harness import REPO, Sandbox, devbox_command, emit, sandbox, summary, wall
from benchmarks.k8s_common import claim_to_shell, cluster_bin

NAMES = ("onprem", "cloud", "spare")
TARGET_ADDED_S = 0.100


@contextlib.contextmanager
def own_clusters(count: int) -> Iterator[list[Path]]:
    folders = [Path(tempfile.mkdtemp(prefix="dbxc", dir="/tmp")) / "cluster" for _ in range(count)]
    try:
        for folder in folders:  # one at a time: two starting at once may pick one port
            env = dict(os.environ, DEVBOX_TEST_CLUSTER_DIR=str(folder), PYTHON=sys.executable)
            subprocess.run(
                [str(REPO / "scripts/test-cluster"), "up"],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        yield [f / "kubeconfig" for f in folders]
    finally:
        for folder in folders:
            subprocess.run(
                [str(REPO / "scripts/test-cluster"), "down"],
                env=dict(os.environ, DEVBOX_TEST_CLUSTER_DIR=str(folder)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
            shutil.rmtree(folder.parent, ignore_errors=True)


def prepare(kubectl: Path, kubeconfig: Path, ns: str) -> None:
    k = [str(kubectl), "--kubeconfig", str(kubeconfig)]
    subprocess.run([*k, "create", "namespace", ns], check=True, capture_output=True)
    for objects in ("agent-rbac.yaml",):
        subprocess.run(
            [*k, "apply", "-n", ns, "-f", str(REPO / "images/k8s" / objects)],
            check=True,
            capture_output=True,
        )
    subprocess.run(
        [*k, "apply", "-f", str(REPO / "images/k8s/cluster.yaml")], check=True, capture_output=True
    )


BASE = (
    'backend = "kubernetes"\nhome_storage_class = "devbox-sim"\n'
    'image = "devbox/box:bench"\nstart_timeout = 300\n'
)


def one_cluster(kubeconfig: Path, ns: str) -> str:
    """The config of one cluster: plain top-level settings, no [clusters]."""
    return BASE + f'kubeconfig = "{kubeconfig}"\nnamespace = "{ns}"\n'


def table(name: str, kubeconfig: Path, ns: str, preference: int) -> str:
    return (
        f'[clusters.{name}]\nkubeconfig = "{kubeconfig}"\nnamespace = "{ns}"\n'
        f"preference = {preference}\n"
    )


def refusing(kubeconfig: Path, folder: Path) -> Path:
    """`kubeconfig` pointed at a loopback port where nothing listens: a cluster that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doc = yaml.safe_load(kubeconfig.read_text())
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path = folder / "down.kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def apiserver_pid(kubeconfig: Path) -> int:
    pids = next((kubeconfig.parent / "kwok/clusters").glob("*/pids"))
    return int((pids / "kube-apiserver.pid").read_text().strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kubeconfigs", type=Path, nargs=3, help="three clusters to use")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        kubeconfigs = args.kubeconfigs or stack.enter_context(own_clusters(3))
        own = args.kubeconfigs is None
        sb = stack.enter_context(sandbox())
        emit(run(sb, list(kubeconfigs), runs=args.runs, own=own))


def run(sb: Sandbox, kubeconfigs: list[Path], *, runs: int, own: bool) -> dict[str, object]:
    kubectl = cluster_bin() / "kubectl"
    ns = f"bench-{os.getpid()}"
    for kubeconfig in kubeconfigs:
        prepare(kubectl, kubeconfig, ns)
    sb.env["DEVBOX_BACKEND"] = "kubernetes"
    sb.env.pop("KUBECONFIG", None)
    config = Path(sb.env["HOME"]) / ".config/devbox/config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    one = one_cluster(kubeconfigs[0], ns)
    tables = [table(n, k, ns, i) for i, (n, k) in enumerate(zip(NAMES, kubeconfigs, strict=True))]
    three = BASE + "".join(tables)
    devbox = devbox_command()

    def use(text: str) -> None:
        config.write_text(text)

    use(one)
    sb.devbox("up", "warmup", "--no-attach")  # the homes volume, the image, caches
    sb.devbox("down", "warmup")
    claims: dict[str, list[float]] = {"one": [], "three": []}
    for i in range(runs):
        for label, text in (("one", one), ("three", three)):
            use(one)  # the pool is the preferred cluster's either way
            sb.devbox("pool", "warm", "--size", "1")  # waits until the warm pod serves
            use(text)
            name = f"{label}{i}"
            claims[label].append(claim_to_shell([*devbox, "up", name], sb.env))
            sb.devbox("down", name)
    listing: dict[str, list[float]] = {"one": [], "three": [], "three_one_down": []}
    # The third cluster swapped for one that is down.
    gone = refusing(kubeconfigs[0], Path(sb.env["HOME"]))
    down = BASE + "".join(tables[:2]) + table("gone", gone, ns, 2)
    use(one)
    sb.devbox("up", "lsbox", "--no-attach")
    for _ in range(runs):
        for label, text in (("one", one), ("three", three), ("three_one_down", down)):
            use(text)
            # A cluster that does not answer is an error line and exit status 1.
            status = 1 if label == "three_one_down" else 0
            listing[label].append(wall([*devbox, "ls"], sb.env, status=status))
    hung: list[float] = []
    if own:  # freeze a cluster of our own only
        pid = apiserver_pid(kubeconfigs[2])
        use(three)
        os.kill(pid, signal.SIGSTOP)
        try:
            hung = [wall([*devbox, "ls"], sb.env, status=1) for _ in range(runs)]
        finally:
            os.kill(pid, signal.SIGCONT)
    use(one)
    sb.devbox("down", "lsbox", check=False)
    for kubeconfig in kubeconfigs:  # clusters not ours keep nothing of this run
        subprocess.run(
            [
                str(kubectl),
                "--kubeconfig",
                str(kubeconfig),
                "delete",
                "namespace",
                ns,
                "--wait=false",
            ],
            capture_output=True,
            check=False,
        )
    one_s, three_s = summary(claims["one"]), summary(claims["three"])
    added = three_s["median"] - one_s["median"]
    result: dict[str, object] = {
        "benchmark": "clusters",
        "runs": runs,
        "load": os.getloadavg(),
        "warm_claim_to_shell": {
            "one_cluster_s": one_s,
            "three_clusters_s": three_s,
            "added_s_median": added,
            "three_over_one": three_s["median"] / one_s["median"],
        },
        "ls_s": {label: summary(v) for label, v in listing.items()}
        | ({"three_one_hung": summary(hung)} if hung else {}),
        "met": {"three_clusters_at_most_100ms_more": added <= TARGET_ADDED_S},
    }
    return result


if __name__ == "__main__":
    main()
