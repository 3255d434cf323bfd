"""Glue between the SSH server and its pod: adopt the owner a claim names, publish the
host key, heartbeat the Lease. Kept apart so a local agent never loads `kubernetes`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import asyncssh

from agent.hostkey import fingerprint
from agent.kube import PodLink, heartbeat_forever
from agent.owner import OwnerError, become
from agent.server import Agent
from devbox import protocol, terminals
from devbox.boxes import release_warning, release_withdrawn

log = logging.getLogger("devbox.agent.incluster")


async def start_link(agent: Agent, args: argparse.Namespace, *, host_line: str) -> threading.Event:
    """Publish the host key, then follow the pod in a thread; returns the event that stops it."""
    loop = asyncio.get_running_loop()
    link = await asyncio.to_thread(
        PodLink, pod=args.pod, namespace=args.namespace, kubeconfig=args.kubeconfig
    )
    await asyncio.to_thread(
        link.annotate,
        {
            protocol.ANN_HOST_KEY: host_line,
            protocol.ANN_HOST_KEY_FP: fingerprint(host_line),
            protocol.ANN_ALERTS: "",  # a new agent: the last one's model alerts are moot
        },
    )
    if agent.probe_hub is not None:

        def publish_alerts(alerts: list[protocol.ProbeAlert]) -> None:
            # `devbox ls` reads model alerts from the pod; off the loop: the API call blocks.
            cell = protocol.alerts_cell(alerts)
            agent.background.offload("publish alerts", link.annotate, {protocol.ANN_ALERTS: cell})

        agent.probe_hub.on_alerts = publish_alerts
    stop = threading.Event()
    adopted: dict[str, str] = {}

    def refuse(what: str, line: str) -> None:
        # Once per new value: a watch replays the pod on every change.
        if adopted.get(f"refused-{what}") == line:
            return
        adopted[f"refused-{what}"] = line
        message = f"refused a new {what} on this pod: a box keeps the one its claim named"
        log.warning("%s", message)
        agent.background.offload(
            "report a refused owner", link.event, protocol.EVENT_OWNER_KEY_REFUSED, message
        )

    def apply(labels: dict[str, str], annotations: dict[str, str]) -> None:
        key_line = annotations.get(protocol.ANN_OWNER_KEY, "")
        owner_name = annotations.get(protocol.ANN_OWNER_NAME, "")
        if not key_line or not owner_name:
            return
        if "key" in adopted:
            # The key seen at the claim is the box's for good: one written later, by
            # whoever could patch the pod, is refused and reported, never adopted.
            if key_line != adopted["key"]:
                refuse("owner key", key_line)
            if owner_name != adopted["owner"]:
                refuse("owner", owner_name)
            return
        try:
            key = asyncssh.import_public_key(key_line)
            home = _take_owner(owner_name)
        except (asyncssh.KeyImportError, OwnerError, OSError) as exc:
            log.error("cannot adopt the owner named on my pod: %s", exc)
            agent.background.offload(
                "report a refused owner", link.event, protocol.EVENT_OWNER_REFUSED, str(exc)
            )
            adopted["key"], adopted["owner"] = key_line, owner_name  # and no other, ever
            return
        box = agent.box
        box.owner_key, box.home = key, home
        box.name = labels.get(protocol.LABEL_BOX) or box.name
        adopted["key"], adopted["owner"] = key_line, owner_name
        log.info("adopted the owner's key %s for box %s", key.get_fingerprint(), box.name)
        # Off the event loop: the API call blocks. The claimer waits for this answer.
        agent.background.offload(
            "acknowledge the owner",
            link.annotate,
            {
                protocol.ANN_OWNER_ACK: key.get_fingerprint(),
                protocol.ANN_ACK_AT: f"{time.time():.3f}",
            },
        )

    def _take_owner(owner_name: str) -> Path:
        if args.become_owner:
            if os.geteuid() != 0:
                # Fail closed: as a shared uid every box could read every home.
                raise OwnerError("cannot become the owner's uid: the agent is not root")
            hub = agent.probe_hub
            # The socket before its folder: root here has no capability to pass through
            # a folder that is no longer its own.
            probe = (hub.path, hub.path.parent) if hub is not None else ()
            # The login name from the owner's name, as the backend labels it: never the
            # label itself, which the claimer writes.
            login = protocol.owner_label(owner_name)
            return become(owner_name, login, args.home_root, also_own=probe)
        home: Path = args.home_root / protocol.home_folder(owner_name)
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        return home

    def warn(annotations: dict[str, str]) -> None:
        # The autoscaler's warning reaches the user where they work: their session and
        # every other terminal of the box. Its withdrawal goes the same way.
        release_at = annotations.get(protocol.ANN_RELEASE_AT, "")
        if not release_at:
            if adopted.pop("warned", ""):
                kept = _seconds(annotations.get(protocol.ANN_KEEP_UNTIL, ""))
                why = "kept (`devbox keep`)" if kept > time.time() else "in use again"
                agent.background.offload("tell", tell, release_withdrawn(agent.box.name, why))
            return
        if adopted.get("warned") == release_at:
            return
        try:
            when = float(release_at)
        except ValueError:
            return
        adopted["warned"] = release_at
        reason = annotations.get(protocol.ANN_RELEASE_REASON, "")
        agent.background.offload("tell", tell, release_warning(agent.box.name, reason, when))

    def tell(text: str) -> None:
        mux = agent.box.multiplexer
        mux.tell(agent.box.name, text)
        table = terminals.Processes()
        # As the telemetry counts the box's processes (agent.main): all this PID namespace
        # shows, or the agent's and the sessions' (marked) with all below them.
        if (args.processes or "all") == "all":
            box = table.every()
        else:
            box = table.below([os.getpid(), *table.marked(f"{protocol.BOX_ENV}={agent.box.name}")])
        programs = terminals.multiplexer_programs(*([mux.path] if mux.path else []))
        told = terminals.tell(text, table=table, box=box, multiplexers=programs)
        log.info("told the session and %d other terminal(s): %s", told, text)

    def on_change(labels: dict[str, str], annotations: dict[str, str]) -> None:
        # The watch thread hands changes to the event loop: the agent's state has one owner.
        loop.call_soon_threadsafe(apply, labels, annotations)
        loop.call_soon_threadsafe(warn, annotations)

    def activity() -> tuple[str, protocol.Activity]:
        return agent.box.name, agent.activity.snapshot()

    async def refresh_owner() -> None:
        try:
            labels, annotations, _ = await asyncio.to_thread(link.read)
        except Exception as exc:  # the API server is unreachable: the watch catches up later
            log.warning("could not read my pod for a new owner: %s", exc)
            return
        apply(labels, annotations)

    agent.box.refresh_owner = refresh_owner
    threading.Thread(
        target=link.follow, args=(on_change, stop), daemon=True, name="pod-watch"
    ).start()
    threading.Thread(
        target=heartbeat_forever,
        args=(link, activity, stop, args.heartbeat),
        daemon=True,
        name="lease",
    ).start()
    return stop


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0
