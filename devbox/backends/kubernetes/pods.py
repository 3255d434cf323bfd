"""Box pods and the homes volume as Kubernetes objects, and pods back into Box records."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any

from devbox import protocol as p
from devbox import saves
from devbox.backends.kubernetes.identity import Identity
from devbox.boxes import Box, BoxSpec, BoxState, Toleration
from devbox.config import Config

HOMES_CLAIM = "devbox-homes"
GPU = "nvidia.com/gpu"
MANAGED = f"{p.LABEL_MANAGED}={p.MANAGED_BY}"
LABEL_GPUS = "devbox.io/gpus"
# A short hash of everything that makes one box pod unlike another (shape()): a claim
# takes only a warm pod of the shape it asked for, so a profile changed by the
# administrator is never served by a pod made before the change.
LABEL_SHAPE = "devbox.io/shape"


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
        "metadata": {"name": HOMES_CLAIM, "labels": {p.LABEL_MANAGED: p.MANAGED_BY}},
        "spec": spec,
    }


def shape(config: Config, spec: BoxSpec) -> str:
    """What a warm pod must match to serve a claim of `spec`: GPUs, CPU, memory, image,
    node selector, tolerations and priority class, hashed into a label value."""
    text = json.dumps(
        {
            "gpus": spec.gpus,
            "cpu": spec.cpu,
            "memory": spec.memory,
            "image": spec.image or config.image,
            "node_selector": sorted(spec.node_selector),
            "tolerations": [_toleration(t) for t in spec.tolerations],
            "priority_class": config.priority_class,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def box_pod(
    config: Config,
    *,
    spec: BoxSpec,
    box: str = "",
    owner: Identity | None = None,
    owner_key: str = "",
) -> dict[str, Any]:
    """A box pod; without an owner it is an unclaimed warm pod of the profile's pool."""
    warm = owner is None
    labels = {
        p.LABEL_MANAGED: p.MANAGED_BY,
        p.LABEL_PROFILE: label_value(spec.profile),
        p.LABEL_STATE: "warm" if warm else "claimed",
        p.LABEL_BOX: box,
        p.LABEL_OWNER: owner.label if owner else "",
        LABEL_GPUS: str(spec.gpus),
        LABEL_SHAPE: shape(config, spec),
    }
    # Requests only, no CPU or memory limits: a dev box is interactive and bursty (a
    # compile, a data loader, a notebook), and a CPU limit throttles it in the middle of
    # the work while a memory limit kills the user's shell; requests alone still place
    # it and count against the namespace's quota.
    resources: dict[str, Any] = {"requests": {"cpu": spec.cpu, "memory": spec.memory}}
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
            # Loopback only: the API server's port-forward connects inside the pod, and
            # nothing else in the cluster should reach the agent before authentication.
            "--listen",
            "127.0.0.1",
            "--port",
            str(p.SSH_PORT),
            "--home-root",
            "/homes",
            "--host-key",
            "/run/devbox/host_key",
            # Starts as root only to make the owner's home and become the owner's uid.
            "--become-owner",
            *config.hang.agent_args(),
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
        # The agent is root until it knows its owner, with only what making the owner's
        # home and switching to the owner's uid need; then it has no capability left.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": list(AGENT_CAPABILITIES)},
        },
        "volumeMounts": [_homes_mount(owner), {"name": "run", "mountPath": "/run/devbox"}],
    }
    metadata: dict[str, Any] = {"labels": labels}
    if owner is None:
        metadata["generateName"] = f"devbox-warm-{label_value(spec.profile)[:20]}-"
    else:
        metadata["name"] = f"devbox-{box}"[:63].rstrip("-")
        metadata["annotations"] = {
            p.ANN_OWNER_KEY: owner_key,
            p.ANN_OWNER_NAME: owner.username,
            p.ANN_CLAIMED_AT: _now(),
        }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "serviceAccountName": config.service_account,
        "restartPolicy": "Always",
        # However the pod is deleted (kubectl, a drain, a preemption), its probed
        # processes get the user's save_timeout to save, as with `devbox down`.
        "terminationGracePeriodSeconds": release_grace(config.save_timeout),
        # No fsGroup: on a volume every user shares, the kubelet would give every file of
        # every home to the group of whichever box started last.
        # The image's user (root, images/box/Dockerfile) until the agent becomes its
        # owner. No runAsUser either: with one, the kubelet makes the service account
        # token root's alone (0600), and the agent could no longer read it as the owner.
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [
            {"name": "homes", "persistentVolumeClaim": {"claimName": HOMES_CLAIM}},
            {"name": "run", "emptyDir": {}},
        ],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [_toleration(t) for t in spec.tolerations]
    if config.priority_class:
        # Warm or claimed alike: priority is fixed when a pod is made and a claim keeps the
        # pod, so a lower-priority warm pod would leave its user preemptible for good. The
        # autoscaler yields unclaimed warm pods to pending GPU work instead.
        pod_spec["priorityClassName"] = config.priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# What the agent needs as root before it becomes its owner (agent/owner.py): make the
# home (CHOWN, FOWNER), empty the bounding set (SETPCAP) and switch uid and groups
# (SETUID, SETGID); and what the container's init, which stays root, needs to pass the
# kubelet's SIGTERM on to the agent once that runs as its owner (KILL: without it the
# init died of EPERM and took the box down at once, before anything could save). All
# within the Pod Security "baseline" level.
AGENT_CAPABILITIES = ("CHOWN", "FOWNER", "KILL", "SETGID", "SETPCAP", "SETUID")


def _homes_mount(owner: Identity | None) -> dict[str, Any]:
    """A box made for its owner mounts the owner's folder only (the admission policy
    requires it); a warm pod, whose owner is not known yet, mounts the volume and its
    agent shows its owner only their own folder, as the owner's uid."""
    if owner is None:
        return {"name": "homes", "mountPath": "/homes"}
    return {"name": "homes", "mountPath": f"/homes/{owner.home}", "subPath": owner.home}


def _toleration(t: Toleration) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": t.operator}
    if t.key:
        out["key"] = t.key
    if t.value:
        out["value"] = t.value
    if t.effect:
        out["effect"] = t.effect
    if t.toleration_seconds is not None:
        out["tolerationSeconds"] = t.toleration_seconds
    return out


def _toleration_of(raw: dict[str, Any]) -> Toleration:
    seconds = raw.get("tolerationSeconds")
    return Toleration(
        key=str(raw.get("key") or ""),
        operator=str(raw.get("operator") or "Equal"),
        value=str(raw.get("value") or ""),
        effect=str(raw.get("effect") or ""),
        toleration_seconds=None if seconds is None else int(seconds),
    )


_SUFFIXES = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_WHOLE = re.compile(r"(\d+)(?:[eE](\d+))?(k|Ki|[MGTPE]i?)?")


def count_of(quantity: object) -> int:
    """A whole-number quantity (a GPU count) as the API server writes it: it canonicalises
    them, so 1000 GPUs read back as "1k". Anything that is not a whole count is 0."""
    if isinstance(quantity, int) and not isinstance(quantity, bool):
        return max(quantity, 0)
    match = _WHOLE.fullmatch(str(quantity).strip()) if quantity is not None else None
    if match is None:
        return 0
    digits, exponent, suffix = match.groups()
    scale: int = 10 ** int(exponent or 0)
    return int(digits) * scale * _SUFFIXES[suffix or ""]


def gpus_requested(pod: dict[str, Any]) -> int:
    """The GPUs a pod's containers ask for (an extended resource's limit is its request)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        total += count_of(
            (res.get("limits") or {}).get(GPU) or (res.get("requests") or {}).get(GPU)
        )
    return total


def claim_patch(
    *, resource_version: str, box: str, owner: Identity, owner_key: str
) -> dict[str, Any]:
    """Claims a warm pod; the resourceVersion makes the API server refuse (409) a pod that
    changed since it was read, so two claimers can never both win it."""
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {
                p.LABEL_STATE: "claimed",
                p.LABEL_BOX: box,
                p.LABEL_OWNER: owner.label,
            },
            "annotations": {
                p.ANN_OWNER_KEY: owner_key,
                p.ANN_OWNER_NAME: owner.username,
                p.ANN_CLAIMED_AT: _now(),
            },
        }
    }


def _state(pod: dict[str, Any]) -> tuple[BoxState, str]:
    if pod["metadata"].get("deletionTimestamp"):
        return BoxState.RELEASING, "being deleted"
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Running":
        return BoxState.RUNNING, ""
    if phase in ("Failed", "Succeeded"):
        return BoxState.FAILED, f"pod {phase.lower()}: {status.get('reason') or ''}".strip(": ")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return BoxState.PENDING, cond.get("message") or cond.get("reason") or "unschedulable"
    return BoxState.PENDING, ""


def release_grace(within: float) -> int:
    """The grace period of a deletion that gives the box's probed processes `within`
    seconds to save: the agent keeps saves.MARGIN of it to end the sessions. With 0
    (`down --now`) the agent asks nothing and only ends the sessions."""
    return math.ceil(max(0.0, within) + saves.MARGIN)


def unchanged(pod: dict[str, Any]) -> dict[str, Any]:
    """A DELETE body that the API server refuses (409) if the pod changed since it was
    read (a claim, a `devbox keep`): a decision made on one pod never hits another."""
    meta = pod["metadata"]
    return {"preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}}


def node_of(pod: dict[str, Any]) -> str:
    """The node the scheduler put the pod on; empty while it waits for one."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


def name(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"])


def annotations_of(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("annotations") or {}


def labels_of(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("labels") or {}


def is_ready_warm(pod: dict[str, Any]) -> bool:
    """Running, not being deleted, and its agent has published the host key."""
    return (
        (pod.get("status") or {}).get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
        and bool(annotations_of(pod).get(p.ANN_HOST_KEY))
    )


def to_box(pod: dict[str, Any], *, activity: p.Activity | None = None) -> Box:
    meta, spec = pod["metadata"], pod.get("spec") or {}
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    state, why = _state(pod)
    containers = spec.get("containers") or [{}]
    resources = containers[0].get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    created = meta.get("creationTimestamp")
    claimed = _seconds(ann.get(p.ANN_CLAIMED_AT))
    selector = spec.get("nodeSelector") or {}
    last_input = p.last_use(activity) if activity else 0.0
    return Box(
        name=labels.get(p.LABEL_BOX) or meta["name"],
        owner=ann.get(p.ANN_OWNER_NAME) or labels.get(p.LABEL_OWNER, ""),
        backend="kubernetes",
        spec=BoxSpec(
            gpus=count_of(limits.get(GPU, 0)),
            profile=labels.get(p.LABEL_PROFILE, ""),
            image=containers[0].get("image", ""),
            cpu=str(requests.get("cpu", "")),
            memory=str(requests.get("memory", "")),
            node_selector=tuple(sorted((str(k), str(v)) for k, v in selector.items())),
            tolerations=tuple(_toleration_of(t) for t in spec.get("tolerations") or []),
        ),
        state=state,
        host=meta["name"],
        port=p.SSH_PORT,
        host_key=ann.get(p.ANN_HOST_KEY, ""),
        host_key_fingerprint=ann.get(p.ANN_HOST_KEY_FP, ""),
        keep_until=_seconds(ann.get(p.ANN_KEEP_UNTIL)),
        release_at=_seconds(ann.get(p.ANN_RELEASE_AT)),
        release_reason=ann.get(p.ANN_RELEASE_REASON, ""),
        unhealthy_since=_seconds(ann.get(p.ANN_UNHEALTHY_SINCE)),
        # A warm pod's box begins when it is claimed, not when the pool made it; the
        # pod's own time is RFC 3339 with a Z, as the API server writes it.
        created_at=claimed or (_rfc3339(created) if created else 0.0),
        # The agent of a warm pod counts from its own start, while the pool held it; the
        # box is its user's from the claim, so idle counts from there too (IDLE <= AGE).
        last_activity=max(last_input, claimed) if last_input else 0.0,
        reason=why,
        place=meta["name"],
        # devbox.probe's model alerts, as the agent publishes them (`devbox ls`)
        alerts=ann.get(p.ANN_ALERTS, ""),
        hung_since=activity.get("hung_since", 0.0) if activity else 0.0,
        extra={"namespace": meta.get("namespace", ""), "node": spec.get("nodeName") or ""},
    )


def _now() -> str:
    return f"{time.time():.3f}"


def _rfc3339(text: str) -> float:
    from datetime import datetime  # here: a claimed box's time is its claimed-at annotation

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _seconds(text: str | None) -> float:
    """An annotation holding unix seconds; anything else (absent, edited by hand) is 0."""
    try:
        return float(text) if text else 0.0
    except ValueError:
        return 0.0
