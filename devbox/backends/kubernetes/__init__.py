"""The Kubernetes backend: a box is a pod running `devbox agent`, reached through the API
server's port-forward, claimed from a warm pool when one is free."""

from __future__ import annotations

import builtins
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from devbox import names, paths, profiles, saves
from devbox import protocol as p
from devbox.backends.kubernetes import api, clusterprofiles, identity, pods, portforward
from devbox.backends.kubernetes.rest import ApiError
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.config import Config
from devbox.errors import DevboxError, ResourceError, UsageError
from devbox.profiles import Profile
from devbox.ssh import known_hosts
from devbox.ssh.keys import ensure_user_key

if TYPE_CHECKING:
    from devbox.autoscaler.world import Inspectable
    from devbox.backends.base import WarmPool
    from devbox.backends.kubernetes import capacity

POLL = 0.05  # seconds between looks at a pod that is starting; a warm claim takes a few


def _gone(call: Callable[[], object]) -> bool:
    """Runs an API call on a pod; True when the pod does not exist (404)."""
    try:
        call()
    except ApiError as exc:
        if exc.status == 404:
            return True
        raise
    return False


class NotScheduled(ResourceError):
    """A new pod found no node within the claim's bound (its pod is deleted): another
    cluster may have room."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class KubernetesBackend:
    name = "kubernetes"
    look_interval = 30.0  # a GET of the pod, from every open connection of every user
    direct_ssh = False  # box.port is the pod's: reached only through the port-forward

    def __init__(self, *, config: Config, progress: Callable[[str], None] = _stderr) -> None:
        self.config = config
        self.progress = progress
        self._cluster: api.Cluster | None = None
        self._me: identity.Identity | None = None

    @property
    def cluster(self) -> api.Cluster:
        if self._cluster is None:
            self._cluster = api.connect(
                context=self.config.context,
                namespace=self.config.namespace,
                path=self.config.kubeconfig,
            )
        return self._cluster

    @property
    def me(self) -> identity.Identity:
        """The user as the API server knows them, never as the laptop says."""
        if self._me is None:
            with api.errors(self.cluster):
                self._me = identity.whoami(self.cluster.rest)
        return self._me

    def _mine(self, pod: dict[str, Any]) -> bool:
        # The owner name, which the admission policy binds to the claimer, not the label:
        # anyone may put any label on a pod of their own.
        return pods.annotations_of(pod).get(p.ANN_OWNER_NAME) == self.me.username

    # --- lookups --------------------------------------------------------------------

    def _pods(self, selector: str) -> builtins.list[dict[str, Any]]:
        c = self.cluster
        return list(c.rest.get(c.pods(), labelSelector=selector)["items"])

    def _find(self, name: str) -> dict[str, Any] | None:
        found = self._pods(f"{pods.MANAGED},{p.LABEL_BOX}={name}")
        return found[0] if found else None

    def _leases(self) -> dict[str, p.Activity]:
        c = self.cluster
        try:
            items = c.rest.get(c.leases(), labelSelector=pods.MANAGED)["items"]
        except ApiError:
            return {}
        out = {}
        for lease in items:
            activity = p.activity_from_annotations(lease["metadata"].get("annotations") or {})
            if activity is not None:
                out[lease["metadata"]["name"]] = activity
        return out

    def list(self) -> builtins.list[Box]:
        with api.errors(self.cluster):
            mine = self._pods(
                f"{pods.MANAGED},{p.LABEL_STATE}=claimed,{p.LABEL_OWNER}={self.me.label}"
            )
            leases = self._leases()  # one request for all boxes, not one per box
        mine = [pod for pod in mine if self._mine(pod)]
        boxes = [pods.to_box(pod, activity=leases.get(pods.name(pod))) for pod in mine]
        return sorted(boxes, key=lambda b: b.name)

    def get(self, name: str) -> Box:
        """The box, without its last input (its Lease: a second request, which `devbox ssh`
        and every `ssh NAME.devbox` would wait for and nobody reads); `list` has it."""
        names.validate_name(name)
        with api.errors(self.cluster):
            pod = self._find(name)
        if pod is None:
            raise UsageError(f"no box named {name!r} in namespace {self.cluster.namespace!r}")
        box = pods.to_box(pod)
        if not self._mine(pod):
            raise UsageError(f"box {name!r} belongs to {box.owner or 'the warm pool'}")
        return box

    def exists(self, name: str) -> bool:
        """Whether any box of any owner is called `name` in the namespace."""
        names.validate_name(name)
        with api.errors(self.cluster):
            return self._find(name) is not None

    def keep(self, name: str, *, until: float) -> Box:
        box = self.get(name)  # the owner's, or a clear error
        c = self.cluster
        # Whole seconds, rounded down: never kept longer than asked. None removes it.
        value = str(int(until)) if until > 0 else None
        with api.errors(c):
            c.rest.patch(
                c.pods(box.place or name),
                {"metadata": {"annotations": {p.ANN_KEEP_UNTIL: value}}},
            )
        return self.get(name)

    def unlisted(self) -> builtins.list[builtins.list[str]]:
        return []  # one place: listed whole, or an error

    def problems(self) -> builtins.list[str]:
        return []

    # --- profiles -------------------------------------------------------------------

    def profiles(self) -> builtins.list[Profile]:
        """Built in, the namespace's ConfigMap devbox-profiles, then the user's config."""
        with api.errors(self.cluster):
            return builtins.list(clusterprofiles.catalog(self.cluster, self.config).values())

    def resolve(self, profile: str, *, gpus: int | None = None) -> BoxSpec:
        with api.errors(self.cluster):
            catalog = clusterprofiles.catalog(self.cluster, self.config)
        return profiles.choose(catalog, profile).spec(gpus=gpus)

    def watch(self, stop: threading.Event) -> Iterator[tuple[str, Box]]:
        """This user's box changes, as ("ADDED" | "MODIFIED" | "DELETED", box), until stop."""
        from devbox.backends.kubernetes import watching

        selector = f"{pods.MANAGED},{p.LABEL_STATE}=claimed,{p.LABEL_OWNER}={self.me.label}"
        return watching.follow(lambda: self.cluster, selector, stop, keep=self._mine)

    # --- claim ----------------------------------------------------------------------

    def claim(
        self,
        spec: BoxSpec,
        *,
        name: str | None = None,
        warm: builtins.list[dict[str, Any]] | None = None,
        schedule_within: float | None = None,
        name_checked: bool = False,
    ) -> Box:
        """The protocol's claim, with what several clusters need (devbox.backends.clusters):
        `warm`, the ready warm pods as `ready_warm` listed them already (None: list them
        now); `schedule_within`, seconds a new pod may wait for a node before it is deleted
        and NotScheduled raised (None: it waits out start_timeout); `name_checked`: the
        caller has seen that no box is called `name`."""
        if self.config.port:
            raise UsageError("--port applies to the local backend only")
        owner_key = ensure_user_key()
        c = self.cluster
        deadline = time.monotonic() + self.config.start_timeout
        with api.errors(c):
            if name is None:
                name = names.generate_name()
            elif not name_checked and warm is None:
                warm = self._free_name_and_warm(spec, name)
            elif not name_checked and self._find(name) is not None:
                raise self._taken(name)
            pod = self._claim_warm(spec, name, owner_key, warm)
            created = pod is None
            if pod is None:
                # A warm pod already mounts the homes volume; only a new pod may be its first.
                self._ensure_homes()
                pod = self._create(spec, name, owner_key)
            pod_name = pods.name(pod)
            try:
                box = self._wait_ready(
                    pod_name,
                    spec=spec,
                    deadline=deadline,
                    first=pod,
                    schedule_within=schedule_within,
                )
            except BaseException:
                if created:  # nothing half-made is left behind
                    self._delete(pod_name, wait=False)
                raise
        known_hosts.pin(box.name, box.host_key)
        return box

    def ready_warm(self, spec: BoxSpec) -> builtins.list[dict[str, Any]]:
        """The warm pods a claim of `spec` may take now: ready, of its very shape. Only a
        pod of that shape: one made before its profile changed serves nobody."""
        selector = f"{self._pool_selector(spec)},{pods.LABEL_SHAPE}={pods.shape(self.config, spec)}"
        with api.errors(self.cluster):
            return [pod for pod in self._pods(selector) if pods.is_ready_warm(pod)]

    def _free_name_and_warm(self, spec: BoxSpec, name: str) -> builtins.list[dict[str, Any]]:
        """ready_warm's pods, having made sure no box is called `name`, in one request: a
        warm pod's box label is empty, so `box in (,NAME)` lists the pool and any box of
        that name. (The pools of other profiles come along, filtered out here: a few pods,
        where a request of its own cost a round trip and the API server's work.)"""
        names.validate_name(name)  # the selector is built from it
        found = self._pods(f"{pods.MANAGED},{p.LABEL_BOX} in (,{name})")
        if any(pods.labels_of(pod).get(p.LABEL_BOX) == name for pod in found):
            raise self._taken(name)
        wanted = {
            p.LABEL_STATE: "warm",
            p.LABEL_PROFILE: pods.label_value(spec.profile),
            pods.LABEL_GPUS: str(spec.gpus),
            pods.LABEL_SHAPE: pods.shape(self.config, spec),
        }
        return [
            pod
            for pod in found
            if wanted.items() <= pods.labels_of(pod).items() and pods.is_ready_warm(pod)
        ]

    def _taken(self, name: str) -> UsageError:
        return UsageError(
            f"a box named {name!r} already exists in namespace {self.cluster.namespace!r}"
        )

    def free_gpus(self) -> builtins.list[capacity.NodeGpus] | None:
        """Allocatable and unrequested GPUs per schedulable node; None: nodes unreadable."""
        from devbox.backends.kubernetes import capacity

        with api.errors(self.cluster):
            return capacity.gpus_by_node(self.cluster.rest)

    def _ensure_homes(self) -> None:
        c = self.cluster
        try:
            c.rest.post(c.claims(), pods.homes_claim(self.config))
        except ApiError as exc:
            if exc.status != 409:  # 409: it exists, as it should after the first claim
                raise

    def _claim_warm(
        self,
        spec: BoxSpec,
        name: str,
        owner_key: str,
        listed: builtins.list[dict[str, Any]] | None,
    ) -> dict[str, Any] | None:
        """The warm pod this claim took, as the PATCH answered it, or None."""
        ready = builtins.list(self.ready_warm(spec) if listed is None else listed)
        # Concurrent claimers start at different pods, so most first tries succeed.
        random.shuffle(ready)
        c = self.cluster
        for pod in ready:
            patch = pods.claim_patch(
                resource_version=pod["metadata"]["resourceVersion"],
                box=name,
                owner=self.me,
                owner_key=owner_key,
            )
            try:
                claimed: dict[str, Any] = c.rest.patch(c.pods(pods.name(pod)), patch)
            except ApiError as exc:
                if exc.status == 409:  # someone else claimed it first: try the next
                    continue
                raise
            self.progress(f"claimed warm pod {pods.name(pod)}")
            return claimed
        return None

    def _create(self, spec: BoxSpec, name: str, owner_key: str) -> dict[str, Any]:
        c = self.cluster
        body = pods.box_pod(self.config, spec=spec, box=name, owner=self.me, owner_key=owner_key)
        try:
            pod = c.rest.post(c.pods(), body)
        except ApiError as exc:
            if exc.status == 409:
                raise self._taken(name) from None
            raise
        self.progress(f"created pod {pods.name(pod)}; waiting for it to start")
        return pod

    def _wait_ready(
        self,
        pod_name: str,
        *,
        spec: BoxSpec,
        deadline: float,
        first: dict[str, Any] | None = None,
        schedule_within: float | None = None,
    ) -> Box:
        """Follow the pod to Running with its agent listening; say what happens.

        Not until the agent has adopted the owner (its owner-ack annotation): an agent
        reads its pod when an unknown key knocks, so the claimer's key is taken at once,
        and the round trip through the pod watch (70 ms of a warm claim) is not waited.
        `first`, the pod as the claim's PATCH or POST answered it, saves the first GET:
        a warm pod is ready in it."""
        c = self.cluster
        seen_events: set[str] = set()
        said = ""
        schedule_by = None if schedule_within is None else time.monotonic() + schedule_within
        while True:
            pod, first = first or c.rest.get(c.pods(pod_name)), None
            ann = pods.annotations_of(pod)
            box = pods.to_box(pod)
            if box.state is BoxState.RUNNING and ann.get(p.ANN_HOST_KEY):
                return box
            if box.state is BoxState.FAILED:
                raise DevboxError(f"box pod {pod_name} failed: {box.reason}")
            # Only a pod that is not ready yet gets here (a warm claim returned above).
            from devbox.backends.kubernetes import capacity

            events = self._report_events(pod_name, seen_events)
            why = self._waiting_for(pod, events)
            if why and why != said:
                said = why
                if why.startswith("waiting for free GPUs"):
                    free = capacity.gpus_by_node(c.rest)
                    most = (
                        max((n.allocatable for n in free), default=0) if free is not None else None
                    )
                    if most is not None and spec.gpus > most:
                        raise ResourceError(
                            f"no node can ever hold {spec.gpus} GPU(s): the largest has "
                            f"{most}; {capacity.describe(free)}"
                        )
                    why = f"{why}; {capacity.describe(free)}"
                self.progress(why)
            now = time.monotonic()
            if schedule_by is not None and now > schedule_by and not pods.node_of(pod):
                raise NotScheduled(
                    f"box pod {pod_name} was not scheduled within {schedule_within:g}s"
                    + (f": {said}" if said else "")
                )
            if now > deadline:
                raise ResourceError(
                    f"box pod {pod_name} was not ready within {self.config.start_timeout:g}s"
                    + (f": {said}" if said else "")
                )
            time.sleep(POLL)

    def _waiting_for(self, pod: dict[str, Any], events: builtins.list[dict[str, Any]]) -> str:
        """What the pod waits for, in words (waiting.py); the homes claim is read only
        when the scheduler says the pod waits for it."""
        from devbox.backends.kubernetes import waiting

        claim: dict[str, Any] | None = None
        claim_events: builtins.list[dict[str, Any]] = []
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any("PersistentVolumeClaim" in (cond.get("message") or "") for cond in conditions):
            c = self.cluster
            try:
                claim = c.rest.get(c.claims(pods.HOMES_CLAIM))
                claim_events = c.rest.get(
                    c.events(), fieldSelector=f"involvedObject.name={pods.HOMES_CLAIM}"
                )["items"]
            except ApiError:
                pass  # not readable: say it waits for the volume, without the cause
        return waiting.describe(
            pod,
            claim=claim,
            claim_events=claim_events,
            pod_events=events,
            config_hint=str(paths.config_file()),
        )

    def _report_events(self, pod_name: str, seen: set[str]) -> builtins.list[dict[str, Any]]:
        """Prints the pod's new start-up events; returns all of them, oldest first. The
        scheduler's refusals are left to _waiting_for, which says them in words."""
        c = self.cluster
        try:
            events = c.rest.get(c.events(), fieldSelector=f"involvedObject.name={pod_name}")
        except ApiError:
            return []
        # RFC 3339 timestamps of one format sort as text.
        ordered = sorted(events["items"], key=lambda e: e["metadata"]["creationTimestamp"])
        for event in ordered:
            if event["metadata"]["uid"] in seen:
                continue
            seen.add(event["metadata"]["uid"])
            if event.get("reason") in (
                "Scheduled",
                "Pulling",
                "Pulled",
                "Created",
                "Started",
                "Failed",
                "BackOff",
            ):
                self.progress(f"  {event['reason']}: {event.get('message', '')}")
        return ordered

    # --- release --------------------------------------------------------------------

    def release(
        self,
        name: str,
        *,
        purge: bool = False,
        confirm: Callable[[str], None] | None = None,
        save: saves.Ask | None = None,
    ) -> bool:
        if purge:
            # A home here is the owner's, shared by all their boxes (ROOT/OWNER on the homes
            # volume), not the box's: releasing one box must never delete it. Refused before
            # anything is stopped.
            raise UsageError(
                "--purge does not apply on Kubernetes: your home is shared by all your boxes "
                "(the homes volume), so releasing one keeps it; `devbox down` without --purge"
            )
        box = self.get(name)
        with api.errors(self.cluster):
            seen = self._delete(
                box.place, wait=True, grace=pods.release_grace(save.within if save else 0.0)
            )
        if save is not None:
            # The agent annotates its pod with what was saved as it ends (agent/saving.py).
            save.results = saves.decode(seen.get(p.ANN_SAVED, ""))
        known_hosts.unpin(name)
        return True

    def _delete(self, pod_name: str, *, wait: bool, grace: int | None = None) -> dict[str, str]:
        """Delete the pod (with `grace` seconds for its agent, None: the pod's own), and with
        `wait` until it is gone; the pod's last annotations seen."""
        c = self.cluster
        body = None if grace is None else {"gracePeriodSeconds": grace}
        seen: dict[str, str] = {}
        if _gone(lambda: c.rest.delete(c.pods(pod_name), body=body)):
            return seen
        # The kubelet gives the agent its grace; the API server's part after is quick.
        deadline = time.monotonic() + (grace or 0) + 60
        while wait and time.monotonic() < deadline:
            try:
                seen = pods.annotations_of(c.rest.get(c.pods(pod_name)))
            except ApiError as exc:
                if exc.status == 404:
                    return seen
                raise
            time.sleep(0.1 if grace is None or grace < 10 else 0.25)
        return seen

    # --- connect --------------------------------------------------------------------

    def open_socket(self, box: Box) -> socket.socket:
        c = self.cluster
        return portforward.open_socket(
            c.rest, namespace=c.namespace, pod=box.place, port=p.SSH_PORT
        )

    def sync_root(self, box: Box) -> str | None:
        return None  # sessions' $HOME is the owner's home in the pod: trees go to ~/FOLDER

    def proxy_stdio(self, box: Box) -> bool:
        """`devbox proxy`: stdin/stdout straight onto the port-forward's WebSocket."""
        c = self.cluster
        portforward.bridge_stdio(c.rest, namespace=c.namespace, pod=box.place, port=p.SSH_PORT)
        return True

    def proxy_args(self, box: Box) -> builtins.list[str]:
        # A box lives in one namespace: pin it, so the alias keeps working whatever
        # namespace later commands default to.
        ns = box.extra.get("namespace")
        return ["--namespace", ns] if ns else []

    def autoscaler_worlds(self) -> builtins.list[tuple[str, Inspectable]]:
        return [("", self.autoscaler_world())]

    def autoscaler_world(self, box: str | None = None) -> Inspectable:
        from devbox.backends.kubernetes.autoscaling import KubeWorld

        return KubeWorld(self)

    # --- warm pool ------------------------------------------------------------------

    def warm_pool(self) -> WarmPool:
        return self

    def pool(self) -> builtins.list[Box]:
        with api.errors(self.cluster):
            warm = self._pods(f"{pods.MANAGED},{p.LABEL_STATE}=warm")
        return [pods.to_box(pod) for pod in warm]

    def _pool_selector(self, spec: BoxSpec) -> str:
        """The warm pods of the spec's profile and GPU count, whatever their shape."""
        return (
            f"{pods.MANAGED},{p.LABEL_STATE}=warm,"
            f"{p.LABEL_PROFILE}={pods.label_value(spec.profile)},{pods.LABEL_GPUS}={spec.gpus}"
        )

    def warm(self, spec: BoxSpec, *, size: int, wait: bool = True) -> builtins.list[Box]:
        """Top the profile's pool up to `size` unclaimed pods of its current shape, deleting
        those of an older shape; returns the pool."""
        c = self.cluster
        selector = self._pool_selector(spec)
        shape = pods.shape(self.config, spec)
        current = f"{selector},{pods.LABEL_SHAPE}={shape}"
        with api.errors(c):
            self._ensure_homes()
            have = 0
            for x in self._pods(selector):
                if x["metadata"].get("deletionTimestamp"):
                    continue
                if (x["metadata"].get("labels") or {}).get(pods.LABEL_SHAPE) == shape:
                    have += 1
                elif self._delete_unclaimed(x):
                    self.progress(
                        f"deleted warm pod {pods.name(x)}: its shape is no longer "
                        f"profile {spec.profile}'s"
                    )
            for _ in range(max(0, size - have)):
                c.rest.post(c.pods(), pods.box_pod(self.config, spec=spec))
            deadline = time.monotonic() + self.config.start_timeout
            while wait:
                ready = [x for x in self._pods(current) if pods.is_ready_warm(x)]
                if len(ready) >= size:
                    break
                if time.monotonic() > deadline:
                    raise ResourceError(
                        f"only {len(ready)} of {size} warm pods became ready "
                        f"within {self.config.start_timeout:g}s"
                    )
                time.sleep(0.2)
            return [pods.to_box(x) for x in self._pods(current)]

    def _delete_unclaimed(self, pod: dict[str, Any]) -> bool:
        """Deletes the warm pod as it was read; False when it is gone or changed since (a
        claim changes it: a claimed box is never deleted by this)."""
        c = self.cluster
        try:
            c.rest.delete(c.pods(pods.name(pod)), body=pods.unchanged(pod))
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True
