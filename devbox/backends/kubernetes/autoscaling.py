"""The autoscaler's view of a namespace: box pods and their Leases from two list-watch
caches; its decisions written back as pod annotations and Events; the warm pools (in
warmpool.py); its settings and memory in ConfigMaps."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from devbox import protocol as p
from devbox.autoscaler import policy
from devbox.autoscaler.config import CONFIG_KEY, CONFIG_MAP
from devbox.autoscaler.state import STATE_CONFIG_MAP, STATE_KEY, State, loads
from devbox.autoscaler.world import Snapshot
from devbox.backends.kubernetes import KubernetesBackend, api, pods
from devbox.backends.kubernetes.informer import Informer
from devbox.backends.kubernetes.rest import ApiError
from devbox.backends.kubernetes.warmpool import WarmPools
from devbox.errors import DevboxError, UsageError

log = logging.getLogger("devbox.autoscaler")
SYNC_TIMEOUT = 60.0
COMPONENT = "devbox-autoscaler"


class KubeWorld:
    def __init__(self, backend: KubernetesBackend) -> None:
        self.backend = backend
        self._stop = threading.Event()
        self._pods: Informer | None = None
        self._leases: Informer | None = None
        self._pending: Informer | None = None
        self._cached: dict[str, Any] = {}  # pod name -> the pod this pass decided on
        self._claims_seen: set[str] = set()
        self._started = time.time()
        self.pools = WarmPools(
            backend,
            event=lambda pod, reason, message, kind: self._event(pod, reason, message, kind=kind),
        )

    @property
    def cluster(self) -> api.Cluster:
        return self.backend.cluster

    def close(self) -> None:
        self._stop.set()

    def _informers(self) -> tuple[Informer, Informer, Informer]:
        if self._pods is None or self._leases is None or self._pending is None:
            c = self.cluster
            self._pods = Informer("pods", c.rest, c.pods(), selector=pods.MANAGED)
            self._leases = Informer("leases", c.rest, c.leases(), selector=pods.MANAGED)
            for informer in (self._pods, self._leases):
                informer.start(self._stop)
            self._pending = self.pools.start(self._stop, timeout=SYNC_TIMEOUT)
            for informer in (self._pods, self._leases):
                informer.wait(SYNC_TIMEOUT)
        return self._pods, self._leases, self._pending

    # --- looking ----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        pod_cache, lease_cache, pending_cache = self._informers()
        for cache in (pod_cache, lease_cache, pending_cache):
            if cache.problem is not None:
                # No decision on a view that may be stale: this pass fails, the next retries.
                raise DevboxError(f"the {cache.what} watch is interrupted: {cache.problem}")
        leases = {lease["metadata"]["name"]: lease for lease in lease_cache.items()}
        facts: list[policy.BoxFacts] = []
        warm_pods: list[dict[str, Any]] = []
        latencies: list[float] = []
        cached: dict[str, Any] = {}
        seen: list[str] = []
        for pod in pod_cache.items():
            labels = pod["metadata"].get("labels") or {}
            name = pods.name(pod)
            seen.append(name)
            if labels.get(p.LABEL_STATE) == "warm":
                warm_pods.append(pod)
                continue
            if labels.get(p.LABEL_STATE) != "claimed":
                continue
            cached[name] = pod
            facts.append(self._facts(pod, leases.get(name)))
            latency = self._claim_latency(pod)
            if latency is not None:
                latencies.append(latency)
        self._cached = cached
        warm, warm_facts, profiles = self.pools.look(warm_pods, seen=seen)
        return Snapshot(
            facts,
            warm,
            latencies,
            warm_pods=warm_facts,
            pending=self.pools.pending(),
            profiles=profiles,
            largest_node_gpus=self.pools.largest_node_gpus(),
        )

    def _facts(self, pod: dict[str, Any], lease: dict[str, Any] | None) -> policy.BoxFacts:
        activity, beat = None, 0.0
        if lease is not None and _owned_by(lease, pod):
            activity = p.activity_from_annotations(lease["metadata"].get("annotations") or {})
            beat = _timestamp((lease.get("spec") or {}).get("renewTime"))
        box = pods.to_box(pod, activity=activity)
        return policy.BoxFacts(key=pods.name(pod), box=box, activity=activity, heartbeat_at=beat)

    def _claim_latency(self, pod: dict[str, Any]) -> float | None:
        """Claim to serving agent, once per pod, for claims made while we run."""
        ann = pods.annotations_of(pod)
        uid = pod["metadata"]["uid"]
        if uid in self._claims_seen or p.ANN_ACK_AT not in ann:
            return None
        self._claims_seen.add(uid)
        claimed, acked = _float(ann.get(p.ANN_CLAIMED_AT)), _float(ann.get(p.ANN_ACK_AT))
        if not claimed or acked < self._started or acked < claimed:
            return None
        return acked - claimed

    # --- acting -----------------------------------------------------------------------

    def apply(self, action: policy.Action) -> bool:
        if isinstance(action, policy.CreateWarm):
            self.pools.create(action)
            return True
        if isinstance(action, policy.Yield | policy.DropStale):
            return self.pools.remove(action)
        pod = self._cached.get(action.key)
        if pod is None:
            return False
        ann: dict[str, str | None]
        with api.errors(self.cluster):
            if isinstance(action, policy.Warn):
                ann = {
                    p.ANN_RELEASE_AT: f"{action.release_at:.0f}",
                    p.ANN_RELEASE_REASON: action.reason,
                }
                when = time.strftime("%H:%M:%S", time.gmtime(action.release_at))
                return self._annotate(
                    pod, ann, "DevboxReleaseWarning", f"release at {when}Z: {action.why}"
                )
            if isinstance(action, policy.Unwarn):
                ann = {p.ANN_RELEASE_AT: None, p.ANN_RELEASE_REASON: None}
                return self._annotate(pod, ann, "DevboxKept", action.why, kind="Normal")
            if isinstance(action, policy.MarkUnhealthy):
                ann = {p.ANN_UNHEALTHY_SINCE: f"{action.since:.0f}"}
                return self._annotate(pod, ann, "DevboxAgentSilent", action.why)
            if isinstance(action, policy.MarkHealthy):
                ann = {p.ANN_UNHEALTHY_SINCE: None}  # None removes it
                return self._annotate(pod, ann, "DevboxAgentBack", action.why, kind="Normal")
            if isinstance(action, policy.Release):
                return self._release(pod, action)
        return False

    def _annotate(
        self,
        pod: dict[str, Any],
        ann: Mapping[str, str | None],
        reason: str,
        message: str,
        *,
        kind: str = "",
    ) -> bool:
        c = self.cluster
        # The resourceVersion makes the API server refuse (409) a pod that changed since
        # this pass looked at it (a `devbox keep` meanwhile): the next pass decides again.
        version = pod["metadata"]["resourceVersion"]
        patch = {"metadata": {"resourceVersion": version, "annotations": dict(ann)}}
        try:
            c.rest.patch(c.pods(pods.name(pod)), patch)
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise
        self._event(pod, reason, message, kind=kind or "Warning")
        return True

    def _release(self, pod: dict[str, Any], action: policy.Release) -> bool:
        c = self.cluster
        # The grace period is the save limit: the kubelet waits that long while the agent
        # asks the box's probed processes to save (agent/saving.py), and this pass does not.
        body = {**pods.unchanged(pod), "gracePeriodSeconds": pods.release_grace(action.save_within)}
        try:
            c.rest.delete(c.pods(pods.name(pod)), body=body)
        except ApiError as exc:
            if exc.status in (404, 409):  # gone already, or changed: never twice, never blind
                return False
            raise
        # The pod goes; its home is a folder on the shared homes volume, which stays.
        self._event(
            pod, "DevboxReleased", f"released ({action.reason}): {action.why}", kind="Warning"
        )
        return True

    def _event(self, pod: dict[str, Any], reason: str, message: str, *, kind: str) -> None:
        c = self.cluster
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{pods.name(pod)}.", "namespace": c.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pods.name(pod),
                "namespace": c.namespace,
                "uid": pod["metadata"]["uid"],
            },
            "reason": reason,
            "message": message[:1000],
            "type": kind,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": socket.gethostname()[:128],
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            c.rest.post(c.events(), body)
        except DevboxError as exc:  # the decision stands; only its record is missing
            log.warning("could not record event %s on %s: %s", reason, pods.name(pod), exc)

    # --- settings, memory, explain ------------------------------------------------------

    def _config_map(self, name: str) -> dict[str, Any] | None:
        c = self.cluster
        with api.errors(c):
            try:
                return c.rest.get(c.config_maps(name))
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise

    def settings_text(self) -> tuple[str, str] | None:
        found = self._config_map(CONFIG_MAP)
        if found is None:
            return None
        where = f"ConfigMap {self.cluster.namespace}/{CONFIG_MAP}"
        data = found.get("data") or {}
        if CONFIG_KEY not in data:
            raise UsageError(f"{where} has no key {CONFIG_KEY!r}")
        return str(data[CONFIG_KEY]), where

    def load_state(self) -> State:
        found = self._config_map(STATE_CONFIG_MAP)
        return loads((found.get("data") or {}).get(STATE_KEY, "")) if found is not None else State()

    def save_state(self, text: str) -> None:
        c = self.cluster
        body = {
            "metadata": {"name": STATE_CONFIG_MAP, "labels": {p.LABEL_MANAGED: p.MANAGED_BY}},
            "data": {STATE_KEY: text},
        }
        with api.errors(c):
            try:
                c.rest.patch(c.config_maps(STATE_CONFIG_MAP), body)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                c.rest.post(c.config_maps(), body)

    def find(self, name: str) -> policy.BoxFacts | None:
        c = self.cluster
        with api.errors(c):
            pod = self.backend._find(name)
            if pod is None:
                return None
            lease: dict[str, Any] | None
            try:
                lease = c.rest.get(c.leases(pods.name(pod)))
            except ApiError as exc:
                if exc.status not in (403, 404):
                    raise
                lease = None
        return self._facts(pod, lease)

    def history(self, facts: policy.BoxFacts | None, name: str) -> list[str]:
        c = self.cluster
        pod = facts.key if facts is not None else name
        try:
            events = c.rest.get(c.events(), fieldSelector=f"involvedObject.name={pod}")["items"]
        except DevboxError:
            return []  # may not list events: the verdict above still stands
        mine = [e for e in events if (e.get("source") or {}).get("component") == COMPONENT]
        # RFC 3339 timestamps of one format sort as text.
        mine.sort(key=lambda e: e["metadata"].get("creationTimestamp") or "")
        out = []
        for e in mine:
            stamp = _timestamp(e["metadata"].get("creationTimestamp"))
            when = time.strftime("%H:%M:%S ", time.gmtime(stamp)) if stamp else ""
            out.append(f"{when}{e.get('reason', '')}: {e.get('message', '')}")
        return out


def _owned_by(lease: dict[str, Any], pod: dict[str, Any]) -> bool:
    """A Lease left by an earlier pod of the same name says nothing about this one."""
    refs = lease["metadata"].get("ownerReferences") or []
    return not refs or any(r.get("uid") == pod["metadata"]["uid"] for r in refs)


def _timestamp(text: str | None) -> float:
    """Unix seconds of an RFC 3339 time as the API server writes it (MicroTime too)."""
    if not text:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _float(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0
