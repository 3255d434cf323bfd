"""Following box pods (and Leases): a watch that survives whatever ends it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from devbox.backends.kubernetes import api, pods
from devbox.backends.kubernetes.rest import ApiError, Rest, Unreachable
from devbox.boxes import Box

LISTED = "LISTED"


def list_then_watch(
    source: Callable[[], tuple[Rest, str]],
    selector: str,
    stop: threading.Event,
    *,
    fields: str = "",
    timeout_seconds: int = 30,
    on_problem: Callable[[str], None] = lambda _: None,
) -> Iterator[tuple[str, Any]]:
    """(LISTED, every object) after each list, then the watch's (kind, object), until stop.

    `source` gives the client and the collection's path; `selector` and `fields` are its
    label and field selectors (an object that stops matching arrives as DELETED). Every
    way a watch can end (its
    timeout, 410 Gone for an expired resourceVersion, the API server restarting) leads
    to the same recovery: list again and watch from the new list's version. Only 401
    and 403, which waiting does not mend, are raised.
    """
    backoff = 0.2
    while not stop.is_set():
        rest, path = source()
        try:
            listing = rest.get(path, labelSelector=selector, fieldSelector=fields)
            yield LISTED, listing["items"]
            backoff = 0.2
            stream = rest.stream(
                path,
                timeout=timeout_seconds + 10,
                watch="true",
                labelSelector=selector,
                fieldSelector=fields,
                resourceVersion=listing["metadata"].get("resourceVersion"),
                timeoutSeconds=timeout_seconds,
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
                yield kind, event["object"]
        except ApiError as exc:
            if exc.status in (401, 403):
                raise
            if exc.status != 410:
                on_problem(f"API error {exc.status}: {exc.message}")
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        except (Unreachable, ValueError) as exc:
            # The API server is restarting or unreachable (or cut a line short): retry,
            # more slowly each time.
            on_problem(f"cannot reach the API server ({type(exc).__name__})")
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)


def follow(
    cluster: Callable[[], api.Cluster],
    selector: str,
    stop: threading.Event,
    keep: Callable[[dict[str, Any]], bool] = lambda pod: True,
) -> Iterator[tuple[str, Box]]:
    """Box changes of the pods matching `selector` and `keep`, until stop; after a
    relist, the difference from what was known."""

    def source() -> tuple[Rest, str]:
        c = cluster()
        return c.rest, c.pods()

    known: dict[str, Box] = {}
    try:
        for kind, payload in list_then_watch(source, selector, stop):
            if kind == LISTED:
                current = {pods.name(x): pods.to_box(x) for x in payload if keep(x)}
                for name, box in current.items():
                    if known.get(name) != box:
                        yield ("MODIFIED" if name in known else "ADDED"), box
                for name in set(known) - set(current):
                    yield "DELETED", known[name]
                known = current
                continue
            if not keep(payload):
                continue
            box = pods.to_box(payload)
            if kind == "DELETED":
                known.pop(pods.name(payload), None)
            else:
                known[pods.name(payload)] = box
            yield kind, box
    except ApiError:
        with api.errors(cluster()):
            raise
