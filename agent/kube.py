"""The in-cluster agent's link to its own pod (the agent's only use of the Kubernetes API).

It publishes the box's host key on the pod, adopts the owner's key when a claim writes
it there (a warm pod is claimed after it started), and heartbeats a coordination Lease
per box that carries the box's activity. Blocking client calls run in threads.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from devbox import protocol

log = logging.getLogger("devbox.agent.kube")

LEASE_SECONDS = 30


class PodLink:
    def __init__(self, *, pod: str, namespace: str, kubeconfig: str | None) -> None:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
        self.pod, self.namespace = pod, namespace
        self.core = client.CoreV1Api()
        self.coord = client.CoordinationV1Api()
        self._uid = ""

    def annotate(self, annotations: dict[str, str]) -> None:
        pod = self.core.patch_namespaced_pod(
            self.pod,
            self.namespace,
            {"metadata": {"annotations": annotations}},
        )
        self._uid = pod.metadata.uid

    def event(self, reason: str, message: str, *, kind: str = "Warning") -> None:
        """A Warning Event on the pod: what `kubectl describe pod` and the owner's
        `devbox up` show. Never fatal: a refusal stands whether or not it is reported."""
        now = datetime.datetime.now(datetime.UTC)
        body = {
            "metadata": {"generateName": f"{self.pod}.", "namespace": self.namespace},
            "involvedObject": {
                "kind": "Pod",
                "name": self.pod,
                "namespace": self.namespace,
                "uid": self._uid,
                "apiVersion": "v1",
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "devbox-agent"},
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(self.namespace, body)
        except Exception as exc:
            log.warning("could not post event %s: %s", reason, exc)

    def read(self) -> tuple[dict[str, str], dict[str, str], str]:
        pod = self.core.read_namespaced_pod(self.pod, self.namespace)
        self._uid = pod.metadata.uid
        return (
            dict(pod.metadata.labels or {}),
            dict(pod.metadata.annotations or {}),
            pod.metadata.resource_version,
        )

    def deletion(self) -> tuple[float, float] | None:
        """(when the pod's grace ends, unix time; its grace in seconds) once it is being
        deleted; None while it is not."""
        meta = self.core.read_namespaced_pod(self.pod, self.namespace).metadata
        if meta.deletion_timestamp is None:
            return None
        return meta.deletion_timestamp.timestamp(), float(meta.deletion_grace_period_seconds or 0)

    def follow(
        self, on_change: Callable[[dict[str, str], dict[str, str]], None], stop: threading.Event
    ) -> None:
        """Calls on_change with the pod's labels and annotations on every change, until stop.

        A watch that ends (timeout, 410 Gone, API server restart) is resumed from a fresh
        read, so no change is missed for long."""
        while not stop.is_set():
            try:
                labels, annotations, version = self.read()
                on_change(labels, annotations)
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    field_selector=f"metadata.name={self.pod}",
                    resource_version=version,
                    timeout_seconds=60,
                )
                for event in stream:
                    if stop.is_set():
                        return
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        return
                    on_change(dict(obj.metadata.labels or {}), dict(obj.metadata.annotations or {}))
            except ApiException as exc:
                if exc.status == 404:
                    log.warning("my pod %s is gone", self.pod)
                    return
                log.warning("pod watch: %s %s; resuming", exc.status, exc.reason)
                stop.wait(1.0)
            except Exception as exc:  # network trouble: the API server may be restarting
                log.warning("pod watch failed (%s); resuming", exc)
                stop.wait(1.0)

    def heartbeat(self, *, box: str, activity: protocol.Activity) -> None:
        if not self._uid:
            # Never a Lease without its owner: the garbage collector deletes the Lease
            # with its pod only if it names the pod, and a box released before a second
            # heartbeat would leave one behind for good.
            self.read()
        now = datetime.datetime.now(datetime.UTC)
        body: dict[str, Any] = {
            "metadata": {
                "name": self.pod,
                "labels": {protocol.LABEL_MANAGED: protocol.MANAGED_BY, protocol.LABEL_BOX: box},
                "annotations": protocol.activity_annotations(activity),
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": self.pod, "uid": self._uid}
                ],
            },
            "spec": {
                "holderIdentity": self.pod,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            },
        }
        try:
            self.coord.patch_namespaced_lease(self.pod, self.namespace, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coord.create_namespaced_lease(self.namespace, body)


def heartbeat_forever(
    link: PodLink,
    read: Callable[[], tuple[str, protocol.Activity]],
    stop: threading.Event,
    interval: float,
) -> None:
    while not stop.is_set():
        box, activity = read()
        try:
            link.heartbeat(box=box, activity=activity)
        except Exception as exc:  # a missed beat is reported, never fatal
            log.warning("lease heartbeat failed: %s", exc)
        stop.wait(interval)
