"""Box pods and the homes volume as Kubernetes objects, and pods back into Box records."""

from __future__ import annotations

import re
import secrets
from datetime import datetime
from typing import Any

from devbox import protocol as p
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.config import Config

HOMES_CLAIM = "devbox-homes"
GPU = "nvidia.com/gpu"
MANAGED = f"{p.LABEL_MANAGED}=devbox"


def label_value(text: str) -> str:
    """A Kubernetes label value (63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")
    return value or "user"


def homes_claim(config: Config) -> dict[str, Any]:
    # One ReadWriteMany volume for every home in the namespace, each user in their own
    # folder: a warm pod is claimed after it started and a running pod's volumes cannot
    # change, so a per-user claim could never be mounted into it.
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": config.home_size}},
    }
    if config.home_storage_class:
        spec["storageClassName"] = config.home_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": HOMES_CLAIM, "labels": {p.LABEL_MANAGED: "devbox"}},
        "spec": spec,
    }


def box_pod(
    config: Config, *, spec: BoxSpec, box: str = "", owner: str = "", owner_key: str = ""
) -> dict[str, Any]:
    """A box pod; without an owner it is an unclaimed warm pod of the profile's pool."""
    warm = not owner
    labels = {
        p.LABEL_MANAGED: "devbox",
        p.LABEL_PROFILE: label_value(spec.profile),
        p.LABEL_STATE: "warm" if warm else "claimed",
        p.LABEL_BOX: box,
        p.LABEL_OWNER: label_value(owner) if owner else "",
        "devbox.io/gpus": str(spec.gpus),
    }
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "2Gi"}}
    if spec.gpus:
        resources["limits"] = {GPU: str(spec.gpus)}
    container = {
        "name": "box",
        "image": spec.image or config.image,
        "command": [
            "devbox",
            "agent",
            "--pod",
            "$(POD_NAME)",
            "--namespace",
            "$(POD_NAMESPACE)",
            "--listen",
            "0.0.0.0",
            "--port",
            str(p.SSH_PORT),
            "--home-root",
            "/homes",
            "--host-key",
            "/run/devbox/host_key",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
        "ports": [{"name": "ssh", "containerPort": p.SSH_PORT}],
        "resources": resources,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "homes", "mountPath": "/homes"},
            {"name": "run", "mountPath": "/run/devbox"},
        ],
    }
    metadata: dict[str, Any] = {"labels": labels}
    if warm:
        metadata["generateName"] = f"devbox-warm-{label_value(spec.profile)[:20]}-"
    else:
        metadata["name"] = f"devbox-{box}"[:63].rstrip("-")
        metadata["annotations"] = {p.ANN_OWNER_KEY: owner_key}
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "serviceAccountName": config.service_account,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 10,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {"name": "homes", "persistentVolumeClaim": {"claimName": HOMES_CLAIM}},
            {"name": "run", "emptyDir": {}},
        ],
    }
    if warm and config.warm_priority_class:
        # Lower priority: real work preempts a warm pod rather than waiting for its GPUs.
        pod_spec["priorityClassName"] = config.warm_priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def claim_patch(*, resource_version: str, box: str, owner: str, owner_key: str) -> dict[str, Any]:
    """Claims a warm pod; the resourceVersion makes the API server refuse (409) a pod that
    changed since it was read, so two claimers can never both win it."""
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {
                p.LABEL_STATE: "claimed",
                p.LABEL_BOX: box,
                p.LABEL_OWNER: label_value(owner),
            },
            "annotations": {p.ANN_OWNER_KEY: owner_key},
        }
    }


def _state(pod: Any) -> tuple[BoxState, str]:
    if pod.metadata.deletion_timestamp:
        return BoxState.RELEASING, "being deleted"
    phase = pod.status.phase if pod.status else "Pending"
    if phase == "Running":
        return BoxState.RUNNING, ""
    if phase in ("Failed", "Succeeded"):
        return BoxState.FAILED, f"pod {phase.lower()}: {pod.status.reason or ''}".strip(": ")
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return BoxState.PENDING, cond.message or cond.reason or "unschedulable"
    return BoxState.PENDING, ""


def to_box(pod: Any, *, last_input: float = 0.0) -> Box:
    labels = pod.metadata.labels or {}
    ann = pod.metadata.annotations or {}
    state, why = _state(pod)
    created: datetime | None = pod.metadata.creation_timestamp
    limits = (pod.spec.containers[0].resources.limits or {}) if pod.spec.containers else {}
    return Box(
        name=labels.get(p.LABEL_BOX) or pod.metadata.name,
        owner=labels.get(p.LABEL_OWNER, ""),
        backend="kubernetes",
        spec=BoxSpec(
            gpus=int(limits.get(GPU, 0)),
            profile=labels.get(p.LABEL_PROFILE, ""),
            image=pod.spec.containers[0].image if pod.spec.containers else "",
        ),
        state=state,
        host=pod.metadata.name,
        port=p.SSH_PORT,
        host_key=ann.get(p.ANN_HOST_KEY, ""),
        host_key_fingerprint=ann.get(p.ANN_HOST_KEY_FP, ""),
        keep_until=_seconds(ann.get(p.ANN_KEEP_UNTIL)),
        created_at=created.timestamp() if created else 0.0,
        last_activity=last_input,
        reason=why,
        extra={
            "pod": pod.metadata.name,
            "namespace": pod.metadata.namespace,
            "node": (pod.spec.node_name or "") if pod.spec else "",
            # devbox.probe's model alerts, as the agent publishes them (`devbox ls`)
            **({"alerts": ann[p.ANN_ALERTS]} if ann.get(p.ANN_ALERTS) else {}),
        },
    )


def random_suffix() -> str:
    return secrets.token_hex(3)


def _seconds(text: str | None) -> float:
    """An annotation holding unix seconds; anything else (absent, edited by hand) is 0."""
    try:
        return float(text) if text else 0.0
    except ValueError:
        return 0.0
