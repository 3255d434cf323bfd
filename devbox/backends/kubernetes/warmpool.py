"""The autoscaler's warm pools in a namespace: what it finds (warm pods and their shapes,
the pods waiting for GPUs) and what it does (make warm pods, delete stale ones, yield them
to pending work). The rules are in devbox.autoscaler.pool; this only looks and acts.

What it looks at comes from list-watch caches (the profiles ConfigMap, the pending pods),
as the box pods do: a pass reads nothing from the API server."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from devbox import profiles
from devbox import protocol as p
from devbox.autoscaler import policy
from devbox.backends.kubernetes import KubernetesBackend, api, clusterprofiles, pods
from devbox.backends.kubernetes.informer import Informer
from devbox.backends.kubernetes.rest import ApiError
from devbox.errors import UsageError
from devbox.profiles import Profile

log = logging.getLogger("devbox.autoscaler")
# A warm pod we created is counted until the cache shows it, or for this long.
CREATING_FOR = 60.0
PENDING = "status.phase=Pending"

Event = Callable[[dict[str, Any], str, str, str], None]  # pod, reason, message, type


class WarmPools:
    def __init__(self, backend: KubernetesBackend, *, event: Event) -> None:
        self.backend = backend
        self._event = event
        self._profiles: Informer | None = None
        self._pending: Informer | None = None
        self._nodes: Informer | None = None  # None: nodes may not be read
        self._catalog: dict[str, Profile] | None = None  # the last good one
        self._catalog_version: str | None = None
        self._catalog_problem = ""
        self._creating: dict[str, tuple[tuple[str, int], float]] = {}
        self._cached: dict[str, dict[str, Any]] = {}  # warm pod name -> as last seen
        self._homes_ready = False

    @property
    def cluster(self) -> api.Cluster:
        return self.backend.cluster

    def start(self, stop: threading.Event, *, timeout: float) -> Informer:
        """Start the caches; returns the pending pods' one, whose problems (a view that
        may be stale) must stop a pass as the box pods' do."""
        c = self.cluster
        name = f"metadata.name={clusterprofiles.CONFIG_MAP}"
        self._profiles = Informer("box profiles", c.rest, c.config_maps(), fields=name)
        self._pending = Informer("pending pods", c.rest, self._pending_path(), fields=PENDING)
        for cache in (self._profiles, self._pending):
            cache.start(stop)
        if self._may_list_nodes():
            self._nodes = Informer("nodes", c.rest, "/api/v1/nodes")
            self._nodes.start(stop)
            self._nodes.settle(timeout)
        self._pending.wait(timeout)
        self._profiles.settle(timeout)  # it may be forbidden: catalog() says so
        return self._pending

    def _may_list_nodes(self) -> bool:
        """Nodes are cluster-wide: readable only with images/k8s/cluster.yaml's optional
        ClusterRole devbox-capacity-reader. Asked once, so that a forbidden watch does not
        retry (and log) forever."""
        c = self.cluster
        with api.errors(c):
            try:
                c.rest.get("/api/v1/nodes", limit="1")
                return True
            except ApiError as exc:
                if exc.status != 403:
                    raise
        log.info("may not list nodes: pods asking for more GPUs than any node has still count")
        return False

    def _pending_path(self) -> str:
        """Pods of every namespace where we may list them (the GPUs are shared), else ours."""
        c = self.cluster
        with api.errors(c):
            try:
                c.rest.get("/api/v1/pods", fieldSelector=PENDING, limit="1")
                return "/api/v1/pods"
            except ApiError as exc:
                if exc.status != 403:
                    raise
        log.info(
            "may not list pods in every namespace: looking for pods waiting for GPUs in %s only",
            c.namespace,
        )
        return c.pods()

    # --- looking ----------------------------------------------------------------------

    def catalog(self) -> dict[str, Profile] | None:
        """The profiles, as the cache has the ConfigMap now (an administrator's change
        applies at the next pass). A broken or unreadable ConfigMap keeps the last good
        profiles (None before any): box releases must not stop over it, and the pools
        must not be rebuilt from a guess."""
        cache = self._profiles
        if cache is None or cache.problem is not None or not cache.synced.is_set():
            why = cache.problem if cache is not None and cache.problem else "not listed yet"
            self._problem(
                f"cannot watch ConfigMap {clusterprofiles.CONFIG_MAP} ({why}; its Role is in "
                "images/k8s/autoscaler.yaml)"
            )
            return self._catalog
        found = cache.items()
        version = found[0]["metadata"].get("resourceVersion", "") if found else ""
        if version == self._catalog_version:
            return self._catalog
        try:
            ns = self.cluster.namespace
            cluster = clusterprofiles.of_config_map(found[0], namespace=ns) if found else ()
            self._catalog = profiles.resolve(cluster, self.backend.config.profiles)
        except UsageError as exc:
            self._problem(exc.message)
            return self._catalog
        self._catalog_version, self._catalog_problem = version, ""
        return self._catalog

    def _problem(self, text: str) -> None:
        if text != self._catalog_problem:  # once, not every pass
            log.warning("profiles unreadable, warm pools keep the last good ones: %s", text)
        self._catalog_problem = text

    def look(
        self, warm: Iterable[dict[str, Any]], *, seen: Iterable[str]
    ) -> tuple[dict[tuple[str, int], int], list[policy.WarmPod], dict[str, int] | None]:
        """Counts of current-shape warm pods per (profile, GPUs), every warm pod as facts,
        and each profile's GPU count, from the cache's unclaimed warm pods. `seen` names
        every pod in the cache: a pod we made that is there, even claimed already (a
        claim within a pass of its making), is no longer one being made."""
        catalog = self.catalog()
        for name in seen:
            self._creating.pop(name, None)
        counts: dict[tuple[str, int], int] = {}
        facts: list[policy.WarmPod] = []
        self._cached = {}
        for pod in warm:
            meta = pod["metadata"]
            labels = meta.get("labels") or {}
            name, profile = pods.name(pod), labels.get(p.LABEL_PROFILE, "")
            gpus = _int(labels.get(pods.LABEL_GPUS))
            self._cached[name] = pod
            current = self._current(catalog, profile, gpus, labels.get(pods.LABEL_SHAPE))
            deleting = bool(meta.get("deletionTimestamp"))
            if current and not deleting:
                counts[(profile, gpus)] = counts.get((profile, gpus), 0) + 1
            facts.append(
                policy.WarmPod(
                    key=name,
                    profile=profile,
                    gpus=gpus,
                    current=current,
                    scheduled=bool((pod.get("spec") or {}).get("nodeName")),
                    deleting=deleting,
                    created_at=pods.to_box(pod).created_at,
                )
            )
        now = time.time()
        for name, (key, since) in list(self._creating.items()):
            if now - since > CREATING_FOR:
                del self._creating[name]
            else:
                counts[key] = counts.get(key, 0) + 1
        gpus_of = {n: prof.gpus for n, prof in catalog.items()} if catalog is not None else {}
        return counts, facts, gpus_of

    def _current(
        self, catalog: dict[str, Profile] | None, profile: str, gpus: int, shape: str | None
    ) -> bool:
        """A warm pod of a profile this autoscaler does not know (a user's own, or with no
        profiles readable) is left alone: it is current as far as it can tell."""
        known = catalog.get(profile) if catalog is not None else None
        if known is None:
            return True
        return shape == pods.shape(self.backend.config, known.spec(gpus=gpus))

    def largest_node_gpus(self) -> int | None:
        """The most allocatable GPUs of one node, from the cache; None when unknown."""
        cache = self._nodes
        if cache is None or cache.problem is not None or not cache.synced.is_set():
            return None
        return max(
            (
                pods.count_of(((n.get("status") or {}).get("allocatable") or {}).get(pods.GPU))
                for n in cache.items()
            ),
            default=0,
        )

    def pending(self) -> list[policy.PendingPod]:
        """Pods waiting for GPUs, from the cache."""
        found = (waiting_for_gpus(pod) for pod in (self._pending.items() if self._pending else []))
        return [x for x in found if x is not None]

    # --- acting -----------------------------------------------------------------------

    def create(self, action: policy.CreateWarm) -> None:
        c = self.cluster
        profile = (self._catalog or {}).get(action.profile)
        if profile is None:
            raise UsageError(f"no profile {action.profile!r} to make warm pods of")
        spec = profile.spec(gpus=action.gpus)
        with api.errors(c):
            if not self._homes_ready:
                self.backend._ensure_homes()
                self._homes_ready = True
            for _ in range(action.count):
                made = c.rest.post(c.pods(), pods.box_pod(self.backend.config, spec=spec))
                self._creating[pods.name(made)] = ((action.profile, action.gpus), time.time())

    def remove(self, action: policy.Yield | policy.DropStale) -> bool:
        """Deletes an unclaimed warm pod as this pass saw it: a pod claimed since has
        changed, and the API server refuses (409) to delete it."""
        pod = self._cached.get(action.key)
        if pod is None:
            return False
        c = self.cluster
        with api.errors(c):
            try:
                c.rest.delete(c.pods(action.key), body=pods.unchanged(pod))
            except ApiError as exc:
                if exc.status in (404, 409):
                    return False
                raise
        if isinstance(action, policy.Yield):
            self._event(pod, "DevboxWarmYielded", f"yielded: {action.why}", "Normal")
        else:
            self._event(pod, "DevboxWarmStale", f"deleted: {action.why}", "Normal")
        return True


def waiting_for_gpus(pod: dict[str, Any]) -> policy.PendingPod | None:
    meta, spec = pod["metadata"], pod.get("spec") or {}
    labels = meta.get("labels") or {}
    if meta.get("deletionTimestamp") or spec.get("nodeName"):
        return None
    if labels.get(p.LABEL_MANAGED) == p.MANAGED_BY and labels.get(p.LABEL_STATE) == "warm":
        return None  # a warm pod waiting for GPUs is no reason to drop another
    gpus = pods.gpus_requested(pod)
    if not gpus:
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
            and pods.GPU in (cond.get("message") or "")
        ):
            key = f"{meta.get('namespace', '')}/{meta['name']}"
            return policy.PendingPod(key=key, gpus=gpus, why=str(cond.get("message"))[:300])
    return None


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
