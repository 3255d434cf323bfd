"""Following box pods: a watch that survives whatever ends it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import urllib3
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from devbox.backends.kubernetes import api, pods
from devbox.boxes import Box


def follow(
    cluster: Callable[[], api.Cluster], selector: str, stop: threading.Event
) -> Iterator[tuple[str, Box]]:
    """Box changes of the pods matching `selector`, until stop.

    Every way a watch can end (its timeout, 410 Gone for an expired resourceVersion, the
    API server restarting) leads to the same recovery: list again, report the difference
    from what was known, and watch from the new list's version.
    """
    known: dict[str, Box] = {}
    backoff = 0.2
    while not stop.is_set():
        c = cluster()
        try:
            listing = c.core.list_namespaced_pod(c.namespace, label_selector=selector)
            current = {x.metadata.name: pods.to_box(x) for x in listing.items}
            for name, box in current.items():
                if known.get(name) != box:
                    yield ("MODIFIED" if name in known else "ADDED"), box
            for name in set(known) - set(current):
                yield "DELETED", known[name]
            known, backoff = current, 0.2
            stream = k8s_watch.Watch().stream(
                c.core.list_namespaced_pod,
                c.namespace,
                label_selector=selector,
                resource_version=listing.metadata.resource_version,
                timeout_seconds=30,
                allow_watch_bookmarks=True,
            )
            for event in stream:
                if stop.is_set():
                    return
                kind = event["type"]
                if kind == "ERROR":  # 410 Gone arrives as an event too: relist
                    break
                if kind == "BOOKMARK":
                    continue
                box = pods.to_box(event["object"])
                name = event["object"].metadata.name
                if kind == "DELETED":
                    known.pop(name, None)
                else:
                    known[name] = box
                yield kind, box
        except ApiException as exc:
            if exc.status in (401, 403):
                with api.errors(c):
                    raise
            if exc.status != 410:
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        except (urllib3.exceptions.HTTPError, OSError):
            # The API server is restarting or unreachable: retry, more slowly each time.
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)
