"""What a box pod that is not running yet waits for, in words a researcher can act on.

Pure: the pod, its home claim and their events in, one line out. The scheduler's own
message ("0/6 nodes are available: 1 node(s) had untolerated taint(s), 5 Insufficient
cpu. no new claims to deallocate, preemption: ...") names every reason a node was
refused; a pod whose claim is not bound never reaches the resource check at all, and
one that is scheduled may still wait for its image. Each gets its own words, so that
`devbox up` never says "waiting for GPUs" about a missing CPU or storage class.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# Scheduler reasons -> what is short, in the order a headline names them.
_SHORT = (
    ("Insufficient nvidia.com/gpu", "GPUs"),
    ("Insufficient cpu", "CPU"),
    ("Insufficient memory", "memory"),
    ("Insufficient ephemeral-storage", "disk"),
    ("Too many pods", "pod slots"),
)
_IMAGE_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
_NO_CLASS = re.compile(r'storageclass\.storage\.k8s\.io "([^"]+)" not found')


def _reasons(message: str) -> list[tuple[int, str]]:
    """(node count, reason) pairs of a FailedScheduling message: its first sentence, as
    the rest is about preemption and claims to deallocate."""
    _, _, listed = message.partition(" are available: ")
    out = []
    for part in (listed or message).split(". ", 1)[0].rstrip(".").split(", "):
        count, _, reason = part.strip().partition(" ")
        if count.isdigit():
            out.append((int(count), reason))
        elif part.strip():
            out.append((0, part.strip()))
    return out


def unschedulable(message: str) -> str:
    """The scheduler's refusal as "waiting for free GPUs and CPU (...)"."""
    reasons = _reasons(message)
    short = [word for key, word in _SHORT if any(key in r for _, r in reasons)]
    details = []
    for count, reason in reasons:
        nodes = f"{count} node{'s' if count != 1 else ''}" if count else ""
        for key, word in _SHORT:
            if key in reason:
                details.append(f"{nodes} short of {word}".strip())
                break
        else:
            if "untolerated taint" in reason:
                details.append(f"{nodes} tainted, not tolerated by the profile".strip())
            elif "affinity/selector" in reason:
                details.append(f"{nodes} outside the profile's node selector".strip())
            elif "unbound" in reason and "PersistentVolumeClaim" in reason:
                return "waiting for the homes volume: its claim is not bound yet"
            else:
                details.append(f"{nodes} {reason}".strip())
    what = " and ".join(short) if short else "a node that fits"
    lead = f"waiting for free {what}" if short else f"waiting for {what}"
    return f"{lead} ({'; '.join(details)})" if details else lead


def claim_problem(
    claim: Mapping[str, Any] | None, events: Iterable[Mapping[str, Any]], *, config_hint: str
) -> str:
    """Why the homes claim is not bound, with what to configure when that is the cause."""
    if claim is None:
        return "waiting for the homes volume: its claim does not exist yet"
    phase = (claim.get("status") or {}).get("phase") or "Pending"
    name = claim.get("metadata", {}).get("name", "")
    cls = (claim.get("spec") or {}).get("storageClassName")
    for event in events:
        text = str(event.get("message") or "")
        missing = _NO_CLASS.search(text)
        if missing:
            return (
                f"the homes volume cannot be made: storage class {missing.group(1)!r} does not "
                f"exist; set home_storage_class in {config_hint} to a ReadWriteMany class "
                "of this cluster (kubectl get storageclass)"
            )
        if "no storage class is set" in text or "no persistent volumes available" in text:
            return (
                f"the homes volume cannot be made: claim {name} names no storage class and "
                f"the cluster has no default; set home_storage_class in {config_hint} to a "
                "ReadWriteMany class of this cluster (kubectl get storageclass)"
            )
    how = f" (storage class {cls!r})" if cls else ""
    return f"waiting for the homes volume: claim {name} is {phase}{how}"


def container_problem(pod: Mapping[str, Any]) -> tuple[str, bool]:
    """(what the scheduled pod's container waits for, whether it is a failure to report
    as such); ("", False) when it waits for nothing worth a word."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason in _IMAGE_FAILURES:
            detail = waiting.get("message") or reason
            return f"cannot pull the image {cs.get('image', '')}: {reason}: {detail}", True
        if reason == "CrashLoopBackOff":
            return f"the box's agent keeps exiting ({waiting.get('message') or reason})", True
    return "", False


def describe(
    pod: Mapping[str, Any],
    *,
    claim: Mapping[str, Any] | None = None,
    claim_events: Iterable[Mapping[str, Any]] = (),
    pod_events: Iterable[Mapping[str, Any]] = (),
    config_hint: str = "your devbox config",
) -> str:
    """One line for a pod that is not running yet ("" when there is nothing to say)."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            message = cond.get("message") or cond.get("reason") or "unschedulable"
            if "unbound" in message and "PersistentVolumeClaim" in message:
                return claim_problem(claim, claim_events, config_hint=config_hint)
            return unschedulable(message)
    problem, _ = container_problem(pod)
    if problem:
        return problem
    if (pod.get("spec") or {}).get("nodeName"):
        for event in pod_events:
            if event.get("reason") == "Pulling":
                return f"pulling the image: {event.get('message', '')}"
        return "starting the box's container"
    return ""
