"""What the cluster has free, so an unschedulable claim can say it plainly."""

from __future__ import annotations

from dataclasses import dataclass

from devbox.backends.kubernetes.pods import GPU, count_of
from devbox.backends.kubernetes.rest import Rest
from devbox.errors import DevboxError

# The GPU model, as NVIDIA's GPU feature discovery labels a node ("NVIDIA-A100-SXM4-80GB").
PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class NodeGpus:
    node: str
    allocatable: int
    free: int
    product: str = ""  # empty: the node does not say


def gpus_by_node(rest: Rest) -> list[NodeGpus] | None:
    """Allocatable and unrequested GPUs per node that takes new pods (a cordoned node is
    left out); None when the user may not list nodes. Reading other namespaces' pods may
    be forbidden too; then free is reported as allocatable (an upper bound). Taints are
    not weighed: whether a pod tolerates them is the scheduler's to say."""
    try:
        nodes = rest.get("/api/v1/nodes")["items"]
    except DevboxError:
        return None
    used: dict[str, int] = {}
    try:
        pods = rest.get(
            "/api/v1/pods", fieldSelector="status.phase!=Succeeded,status.phase!=Failed"
        )["items"]
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if not node:
                continue
            for c in pod["spec"].get("containers") or []:
                limits = (c.get("resources") or {}).get("limits") or {}
                used[node] = used.get(node, 0) + count_of(limits.get(GPU, 0))
    except DevboxError:  # forbidden or unreachable: keep the upper bound
        used = {}
    out = []
    for node in nodes:
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        alloc = count_of(((node.get("status") or {}).get("allocatable") or {}).get(GPU, 0))
        name = node["metadata"]["name"]
        product = str((node["metadata"].get("labels") or {}).get(PRODUCT_LABEL, ""))
        if alloc:
            out.append(NodeGpus(name, alloc, max(0, alloc - used.get(name, 0)), product))
    return out


def describe(nodes: list[NodeGpus] | None) -> str:
    if nodes is None:
        return "(you may not list nodes, so free GPUs are unknown)"
    if not nodes:
        return "the cluster has no GPU nodes"
    free = sum(n.free for n in nodes)
    best = max(n.free for n in nodes)
    return (
        f"the cluster has {free} GPU(s) free, at most {best} on one node "
        f"({', '.join(f'{n.node}: {n.free}/{n.allocatable}' for n in nodes)})"
    )
