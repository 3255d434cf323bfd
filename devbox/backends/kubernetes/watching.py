"""Following box pods: a watch that survives whatever ends it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from devbox.backends.kubernetes import api, pods
from devbox.backends.kubernetes.rest import ApiError, Unreachable
from devbox.boxes import Box

WATCH_SECONDS = 30  # the server ends each watch after this; the loop lists and goes on


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
            listing = c.rest.get(c.pods(), labelSelector=selector)
            current = {pods.name(x): pods.to_box(x) for x in listing["items"]}
            for name, box in current.items():
                if known.get(name) != box:
                    yield ("MODIFIED" if name in known else "ADDED"), box
            for name in set(known) - set(current):
                yield "DELETED", known[name]
            known, backoff = current, 0.2
            stream = c.rest.stream(
                c.pods(),
                timeout=WATCH_SECONDS + 10,
                watch="true",
                labelSelector=selector,
                resourceVersion=listing["metadata"].get("resourceVersion"),
                timeoutSeconds=WATCH_SECONDS,
                allowWatchBookmarks="true",
            )
            for event in stream:
                if stop.is_set():
                    return
                kind = event.get("type")
                if kind == "ERROR":  # 410 Gone arrives as an event too: relist
                    break
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue  # BOOKMARK, or a type newer than this code
                pod = event["object"]
                box = pods.to_box(pod)
                if kind == "DELETED":
                    known.pop(pods.name(pod), None)
                else:
                    known[pods.name(pod)] = box
                yield kind, box
        except ApiError as exc:
            if exc.status in (401, 403):
                with api.errors(c):
                    raise
            if exc.status != 410:
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        except (Unreachable, ValueError):
            # The API server is restarting or unreachable (or cut a line short): retry,
            # more slowly each time.
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)
