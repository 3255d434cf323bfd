"""Following box pods (and Leases): a watch that survives whatever ends it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import urllib3
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from devbox.backends.kubernetes import api, pods
from devbox.boxes import Box

LISTED = "LISTED"


def list_then_watch(
    source: Callable[[], tuple[Callable[..., Any], str]],
    selector: str,
    stop: threading.Event,
    *,
    timeout_seconds: int = 30,
    on_problem: Callable[[str], None] = lambda _: None,
) -> Iterator[tuple[str, Any]]:
    """(LISTED, every object) after each list, then the watch's (kind, object), until stop.

    `source` gives the list call and the namespace. Every way a watch can end (its
    timeout, 410 Gone for an expired resourceVersion, the API server restarting) leads
    to the same recovery: list again and watch from the new list's version. Only 401
    and 403, which waiting does not mend, are raised.
    """
    backoff = 0.2
    while not stop.is_set():
        list_call, namespace = source()
        try:
            listing = list_call(namespace, label_selector=selector)
            yield LISTED, listing.items
            backoff = 0.2
            stream = k8s_watch.Watch().stream(
                list_call,
                namespace,
                label_selector=selector,
                resource_version=listing.metadata.resource_version,
                timeout_seconds=timeout_seconds,
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
                yield kind, event["object"]
        except ApiException as exc:
            if exc.status in (401, 403):
                raise
            if exc.status != 410:
                on_problem(f"API error {exc.status}: {exc.reason}")
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # The API server is restarting or unreachable: retry, more slowly each time.
            on_problem(f"cannot reach the API server ({type(exc).__name__})")
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)


def follow(
    cluster: Callable[[], api.Cluster], selector: str, stop: threading.Event
) -> Iterator[tuple[str, Box]]:
    """Box changes of the pods matching `selector`, until stop; after a relist, the
    difference from what was known."""

    def source() -> tuple[Callable[..., Any], str]:
        c = cluster()
        return c.core.list_namespaced_pod, c.namespace

    known: dict[str, Box] = {}
    try:
        for kind, payload in list_then_watch(source, selector, stop):
            if kind == LISTED:
                current = {x.metadata.name: pods.to_box(x) for x in payload}
                for name, box in current.items():
                    if known.get(name) != box:
                        yield ("MODIFIED" if name in known else "ADDED"), box
                for name in set(known) - set(current):
                    yield "DELETED", known[name]
                known = current
                continue
            box = pods.to_box(payload)
            if kind == "DELETED":
                known.pop(payload.metadata.name, None)
            else:
                known[payload.metadata.name] = box
            yield kind, box
    except ApiException:
        with api.errors(cluster()):
            raise
