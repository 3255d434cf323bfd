"""What the cluster has free, so an unschedulable claim can say it plainly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devbox.backends.kubernetes.pods import GPU


@dataclass(frozen=True)
class NodeGpus:
    node: str
    allocatable: int
    free: int


def gpus_by_node(core: Any) -> list[NodeGpus] | None:
    """Allocatable and unrequested GPUs per node; None when the user may not list nodes.
    Reading other namespaces' pods may be forbidden too; then free is reported as
    allocatable (an upper bound)."""
    try:
        nodes = core.list_node().items
    except Exception:
        return None
    used: dict[str, int] = {}
    try:
        pods = core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed"
        ).items
        for pod in pods:
            if not pod.spec.node_name:
                continue
            for c in pod.spec.containers:
                limits = (c.resources.limits or {}) if c.resources else {}
                used[pod.spec.node_name] = used.get(pod.spec.node_name, 0) + int(limits.get(GPU, 0))
    except Exception:  # forbidden or unreachable: keep the upper bound
        used = {}
    out = []
    for node in nodes:
        alloc = int((node.status.allocatable or {}).get(GPU, 0))
        if alloc:
            out.append(
                NodeGpus(node.metadata.name, alloc, max(0, alloc - used.get(node.metadata.name, 0)))
            )
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
