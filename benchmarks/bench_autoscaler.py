"""One autoscaler reconcile pass over many boxes on the simulated cluster (a private
scripts/test-cluster): wall time and API requests per pass, at two sizes, so that a
constant request count shows as the same number at both. Peer: polling each box (its
pod and its Lease) once, what an autoscaler without list-watch does every pass.

The box pods carry the label devbox.io/no-agent, which the test cluster's pod runner
skips: 1000 real agents would not fit on the machine. Each box's Lease (what its agent
would heartbeat) is written directly, half of them busy (GPU), half idle recently.
Targets: pass <= 2 s at the largest size; requests per pass the same at every size.

    python benchmarks/bench_autoscaler.py [--boxes 100,1000] [--passes 5]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.bench_k8s import private_cluster
from benchmarks.harness import emit, summary

NODE = """apiVersion: v1
kind: Node
metadata:
  name: bench-node
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {type: kwok, kubernetes.io/hostname: bench-node}
status:
  capacity: {cpu: "1000", memory: 4Ti, pods: "5000"}
  allocatable: {cpu: "1000", memory: 4Ti, pods: "5000"}
"""


class Counter:
    """Counts the HTTP requests devbox's client starts (watch streams included)."""

    def __init__(self, rest: Any) -> None:
        self.count = 0
        lock = threading.Lock()
        for verb in ("request", "stream"):
            original = getattr(rest, verb)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                with lock:
                    self.count += 1
                return _original(*args, **kwargs)

            setattr(rest, verb, counted)


def _pod(ns: str, i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"devbox-b{i}",
            "namespace": ns,
            "labels": {
                "app.kubernetes.io/managed-by": "devbox",
                "devbox.io/state": "claimed",
                "devbox.io/box": f"b{i}",
                "devbox.io/owner": f"user{i % 20}",
                "devbox.io/profile": "default",
                "devbox.io/gpus": "1",
                "devbox.io/no-agent": "true",
            },
        },
        "spec": {
            "nodeName": "bench-node",
            "containers": [{"name": "box", "image": "devbox/box:bench"}],
        },
    }


def _lease(ns: str, i: int, now: float) -> dict[str, Any]:
    busy = i % 2 == 0
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": f"devbox-b{i}",
            "namespace": ns,
            "labels": {"app.kubernetes.io/managed-by": "devbox", "devbox.io/box": f"b{i}"},
            "annotations": {
                "devbox.io/last-input": f"{now - 60:.3f}",
                "devbox.io/clients": "0",
                "devbox.io/last-probe": "0",
                "devbox.io/runs": "0",
                "devbox.io/gpu-util": "95.0" if busy else "0.0",
                "devbox.io/cpu": "0.0",
            },
        },
        "spec": {
            "holderIdentity": f"devbox-b{i}",
            "leaseDurationSeconds": 30,
            "renewTime": datetime.datetime.fromtimestamp(now, datetime.UTC).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ"
            ),
        },
    }


def populate(rest: Any, ns: str, count: int) -> None:
    rest.post("/api/v1/namespaces", {"metadata": {"name": ns}})
    now = time.time()
    pods_path = f"/api/v1/namespaces/{ns}/pods"
    leases_path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: rest.post(pods_path, _pod(ns, i)), range(count)))
        leases = [_lease(ns, i, now) for i in range(count)]
        list(pool.map(lambda body: rest.post(leases_path, body), leases))
    deadline = time.monotonic() + 600
    while True:  # kwok marks them Running
        pods = rest.get(pods_path)["items"]
        if sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Running") == count:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"pods of {ns} did not all run within 600 s")
        time.sleep(1)


def measure(ns: str, passes: int) -> dict[str, Any]:
    from devbox.autoscaler.config import Settings
    from devbox.autoscaler.loop import Autoscaler
    from devbox.backends.kubernetes import KubernetesBackend
    from devbox.backends.kubernetes.autoscaling import KubeWorld
    from devbox.config import Config

    backend = KubernetesBackend(config=Config(namespace=ns), progress=lambda _: None)
    counter = Counter(backend.cluster.rest)
    world = KubeWorld(backend)
    # The settings of a real deployment; nobody is due for a warning in this population.
    scaler = Autoscaler(world, Settings(grace=0))
    start = time.perf_counter()
    world.snapshot()  # the informers' initial list and watch: once per process
    sync_s = time.perf_counter() - start
    sync_requests = counter.count
    scaler.reconcile()  # the first pass writes the memory ConfigMap
    walls, requests = [], []
    for _ in range(passes):
        before = counter.count
        result = scaler.reconcile()
        walls.append(result.seconds)
        requests.append(counter.count - before)
        boxes = len(result.decision.verdicts)
        statuses = sorted({v.status for v in result.decision.verdicts})
    world.close()
    # The peer: one look at each box, as a polling autoscaler makes every pass.
    c = backend.cluster
    before = counter.count
    start = time.perf_counter()
    for pod in c.rest.get(c.pods())["items"]:
        name = pod["metadata"]["name"]
        c.rest.get(c.pods(name))
        with contextlib.suppress(Exception):
            c.rest.get(c.leases(name))
    poll_s = time.perf_counter() - start
    return {
        "boxes": boxes,
        "statuses": statuses,
        "pass_s": summary(walls),
        "requests_per_pass": requests,
        "initial_sync_s": sync_s,
        "initial_sync_requests": sync_requests,
        "peer_poll_each_box_s": poll_s,
        "peer_poll_each_box_requests": counter.count - before,
        "peer_over_pass": poll_s / summary(walls)["median"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boxes", default="100,1000", help="sizes, comma-separated")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(x) for x in args.boxes.split(",")]
    # One private control plane at a time (as tests/k8s/conftest.py's private_cluster).
    lock = open("/tmp/devbox-private-cluster.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    with private_cluster() as (kubeconfig, kubectl):
        os.environ["KUBECONFIG"] = str(kubeconfig)
        import subprocess

        subprocess.run(
            [str(kubectl), "--kubeconfig", str(kubeconfig), "apply", "-f", "-"],
            input=NODE.encode(),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        from devbox.backends.kubernetes import api

        cluster = api.connect()
        runs = {}
        for size in sizes:
            ns = f"bench-{size}"
            start = time.perf_counter()
            populate(cluster.rest, ns, size)
            made = time.perf_counter() - start
            runs[str(size)] = {**measure(ns, args.passes), "populate_s": made}
    largest = runs[str(max(sizes))]
    emit(
        {
            "benchmark": "autoscaler",
            "runs": runs,
            "targets": {"pass_s_max": 2.0, "requests_per_pass": "the same at every size"},
            "largest_pass_s": largest["pass_s"]["median"],
            "constant_requests": len({r for x in runs.values() for r in x["requests_per_pass"]})
            == 1,
        }
    )


if __name__ == "__main__":
    main()
