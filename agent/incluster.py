"""Glue between the SSH server and its pod: adopt the owner a claim names, publish the
host key, heartbeat the Lease. Kept apart so a local agent never loads `kubernetes`."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from agent import notices
from agent.activity import Activity
from agent.hostkey import fingerprint
from agent.kube import PodLink, heartbeat_forever
from agent.owner import OwnerError, become
from agent.probehub import ProbeHub
from agent.server import BoxIdentity
from agent.services import AgentServices
from agent.tasks import Tasks
from devbox import protocol, saves
from devbox.boxes import release_warning, release_withdrawn

log = logging.getLogger("devbox.agent.incluster")


@dataclass(frozen=True, kw_only=True)
class PodSettings:
    pod: str
    namespace: str
    kubeconfig: str | None  # None: the pod's service account
    home_root: Path  # where homes live; the owner's is ROOT/OWNER
    become_owner: bool  # started as root: make the owner's home and run as their uid
    heartbeat: float  # Lease renewal period (s)
    # As the telemetry counts the box's processes: all this PID namespace shows, or the
    # agent's and the sessions' (marked) with all below them.
    all_processes: bool


class PodBinding:
    """The agent's side of its pod. The pod watch and the Lease run in threads of their
    own (the client blocks); what they bring is applied on the event loop, the one owner
    of the box's state, and every API call made from there runs off it."""

    def __init__(
        self,
        link: PodLink,
        *,
        settings: PodSettings,
        box: BoxIdentity,
        activity: Activity,
        probe_hub: ProbeHub | None,
        tasks: Tasks,
    ) -> None:
        self._link = link
        self._settings = settings
        self._box = box
        self._activity = activity
        self._probe_hub = probe_hub
        self._tasks = tasks
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        # The owner key line and name seen at the claim (or refused then): the box's for
        # good, whatever is written on the pod later.
        self._claim: tuple[str, str] | None = None
        # Per refused thing, its last refused value: a watch replays the pod on every change.
        self._refused: dict[str, str] = {}
        self._warned = ""  # the release time of the warning last told, "" when none stands
        self._release_reason = ""

    @classmethod
    async def start(
        cls, *, settings: PodSettings, box: BoxIdentity, services: AgentServices, host_line: str
    ) -> PodBinding:
        """Publish the host key, then follow the pod and heartbeat its Lease in threads."""
        link = await asyncio.to_thread(
            PodLink, pod=settings.pod, namespace=settings.namespace, kubeconfig=settings.kubeconfig
        )
        await asyncio.to_thread(
            link.annotate,
            {
                protocol.ANN_HOST_KEY: host_line,
                protocol.ANN_HOST_KEY_FP: fingerprint(host_line),
                protocol.ANN_ALERTS: "",  # a new agent: the last one's model alerts are moot
            },
        )
        binding = cls(
            link,
            settings=settings,
            box=box,
            activity=services.activity,
            probe_hub=services.probe_hub,
            tasks=services.tasks,
        )
        threading.Thread(
            target=link.follow,
            args=(binding._on_change, binding._stop),
            daemon=True,
            name="pod-watch",
        ).start()
        threading.Thread(
            target=heartbeat_forever,
            args=(link, binding._lease_activity, binding._stop, settings.heartbeat),
            daemon=True,
            name="lease",
        ).start()
        return binding

    def stop(self) -> None:
        self._stop.set()

    def publish_alerts(self, alerts: list[protocol.ProbeAlert]) -> None:
        """`devbox ls` reads model alerts from the pod."""
        cell = protocol.alerts_cell(alerts)
        self._call("annotate alerts", self._link.annotate, {protocol.ANN_ALERTS: cell})

    async def ending(
        self,
    ) -> tuple[float, str, Callable[[list[protocol.SaveResult]], Awaitable[None]]]:
        """The pod is being deleted: (until when its processes may save, why, how to
        publish what they saved). The deletion's grace period is the limit (the kubelet
        kills the container when it ends), less saves.MARGIN for what comes after."""
        try:
            deletion = await asyncio.to_thread(self._link.deletion)
        except Exception as exc:  # no API server: the box ends without asking
            log.warning("could not read my pod's deletion: %s", exc)
            deletion = None
        deadline = 0.0
        if deletion is not None:
            ends, grace = deletion
            # The node's clock and the API server's may differ: never past the grace.
            deadline = min(ends, time.time() + grace) - saves.MARGIN
        reason = self._release_reason or "deleted"
        return deadline, reason, self._publish_saved

    async def _publish_saved(self, results: list[protocol.SaveResult]) -> None:
        """`devbox down` reads the annotation as it waits for the pod to go; the event
        stays after it (`kubectl get events`)."""
        said = "; ".join(saves.line(r) for r in results)
        await asyncio.to_thread(self._link.annotate, {protocol.ANN_SAVED: saves.encode(results)})
        await asyncio.to_thread(self._link.event, "DevboxSaved", said[:1000], kind="Normal")

    async def refresh_owner(self) -> None:
        """Read the pod now, for an owner the watch has not brought yet."""
        try:
            labels, annotations, _ = await asyncio.to_thread(self._link.read)
        except Exception as exc:  # the API server is unreachable: the watch catches up later
            log.warning("could not read my pod for a new owner: %s", exc)
            return
        self._apply(labels, annotations)

    def _call(self, what: str, blocking: Callable[..., object], *args: object) -> None:
        # Off the event loop: the API calls and the terminals' writes block.
        self._tasks.spawn(f"pod: {what}", asyncio.to_thread(blocking, *args))

    # --- what the watch thread brings ----------------------------------------------------

    def _on_change(self, labels: dict[str, str], annotations: dict[str, str]) -> None:
        # The watch thread hands changes to the event loop: the agent's state has one owner.
        self._loop.call_soon_threadsafe(self._apply, labels, annotations)
        self._loop.call_soon_threadsafe(self._warn, annotations)

    def _lease_activity(self) -> tuple[str, protocol.Activity]:
        return self._box.name, self._activity.snapshot()

    # --- the owner ---------------------------------------------------------------------

    def _apply(self, labels: dict[str, str], annotations: dict[str, str]) -> None:
        key_line = annotations.get(protocol.ANN_OWNER_KEY, "")
        owner_name = annotations.get(protocol.ANN_OWNER_NAME, "")
        if not key_line or not owner_name:
            return
        if self._claim is not None:
            # The key seen at the claim is the box's for good: one written later, by
            # whoever could patch the pod, is refused and reported, never adopted.
            claimed_key, claimed_owner = self._claim
            if key_line != claimed_key:
                self._refuse("owner key", key_line)
            if owner_name != claimed_owner:
                self._refuse("owner", owner_name)
            return
        try:
            key = asyncssh.import_public_key(key_line)
            home = self._take_owner(owner_name)
        except (asyncssh.KeyImportError, OwnerError, OSError) as exc:
            log.error("cannot adopt the owner named on my pod: %s", exc)
            self._call("refusal event", self._link.event, protocol.EVENT_OWNER_REFUSED, str(exc))
            self._claim = (key_line, owner_name)  # and no other, ever
            return
        # The home is where sessions start and SFTP paths resolve: the server reads it
        # from the box as it serves each channel.
        box = self._box
        box.owner_key, box.home = key, home
        box.name = labels.get(protocol.LABEL_BOX) or box.name
        self._claim = (key_line, owner_name)
        log.info("adopted the owner's key %s for box %s", key.get_fingerprint(), box.name)
        # The claimer waits for this answer.
        self._call(
            "owner acknowledgement",
            self._link.annotate,
            {
                protocol.ANN_OWNER_ACK: key.get_fingerprint(),
                protocol.ANN_ACK_AT: f"{time.time():.3f}",
            },
        )

    def _refuse(self, what: str, line: str) -> None:
        if self._refused.get(what) == line:
            return
        self._refused[what] = line
        message = f"refused a new {what} on this pod: a box keeps the one its claim named"
        log.warning("%s", message)
        self._call("refusal event", self._link.event, protocol.EVENT_OWNER_KEY_REFUSED, message)

    def _take_owner(self, owner_name: str) -> Path:
        settings = self._settings
        if settings.become_owner:
            if os.geteuid() != 0:
                # Fail closed: as a shared uid every box could read every home.
                raise OwnerError("cannot become the owner's uid: the agent is not root")
            hub = self._probe_hub
            # The socket before its folder: root here has no capability to pass through
            # a folder that is no longer its own.
            probe = (hub.path, hub.path.parent) if hub is not None else ()
            # The login name from the owner's name, as the backend labels it: never the
            # label itself, which the claimer writes.
            login = protocol.owner_label(owner_name)
            return become(owner_name, login, settings.home_root, also_own=probe)
        home = settings.home_root / protocol.home_folder(owner_name)
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        return home

    # --- the autoscaler's warnings -------------------------------------------------------

    def _warn(self, annotations: dict[str, str]) -> None:
        # The autoscaler's warning reaches the user where they work: their session and
        # every other terminal of the box. Its withdrawal goes the same way.
        release_at = annotations.get(protocol.ANN_RELEASE_AT, "")
        # Why the box goes, should it go now (what probe.on_release is told): the standing
        # warning's reason; a deletion without one is a `devbox down` or a kubectl's.
        reason = annotations.get(protocol.ANN_RELEASE_REASON, "")
        self._release_reason = reason if release_at else ""
        if not release_at:
            if self._warned:
                self._warned = ""
                kept = _seconds(annotations.get(protocol.ANN_KEEP_UNTIL, ""))
                why = "kept (`devbox keep`)" if kept > time.time() else "in use again"
                self._call("tell", self._tell, release_withdrawn(self._box.name, why))
            return
        if self._warned == release_at:
            return
        try:
            when = float(release_at)
        except ValueError:
            return
        self._warned = release_at
        reason = annotations.get(protocol.ANN_RELEASE_REASON, "")
        self._call("tell", self._tell, release_warning(self._box.name, reason, when))

    def _tell(self, text: str) -> None:
        notices.tell(self._box, text, all_processes=self._settings.all_processes)


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0
