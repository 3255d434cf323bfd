"""A list-watch cache of one kind of object: the autoscaler reads this, never the API
server, so a reconcile pass costs no request per box (or any read at all)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from devbox.errors import DevboxError

log = logging.getLogger("devbox.autoscaler.informer")


class Informer:
    """Objects of `list_call` in `namespace` matching `selector`, kept current by a watch.

    Every way a watch can end (its timeout, 410 Gone, the API server restarting) leads to
    the same recovery as backends/kubernetes/watching.py: list again, watch from there."""

    def __init__(
        self, what: str, list_call: Callable[..., Any], *, namespace: str, selector: str
    ) -> None:
        self.what = what
        self._list, self._namespace, self._selector = list_call, namespace, selector
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self.problem: str | None = None  # why the cache may be stale, while it is

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, args=(stop,), name=f"informer-{self.what}", daemon=True
        )
        thread.start()
        return thread

    def items(self) -> list[Any]:
        with self._lock:
            return list(self._items.values())

    def wait(self, timeout: float) -> None:
        if not self.synced.wait(timeout):
            raise DevboxError(f"could not list {self.what}: {self.problem or 'no answer'}")

    def _run(self, stop: threading.Event) -> None:
        backoff = 0.2
        while not stop.is_set():
            try:
                listing = self._list(self._namespace, label_selector=self._selector)
                with self._lock:
                    self._items = {x.metadata.name: x for x in listing.items}
                self.synced.set()
                self.problem, backoff = None, 0.2
                stream = k8s_watch.Watch().stream(
                    self._list,
                    self._namespace,
                    label_selector=self._selector,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    if stop.is_set():
                        return
                    kind = event["type"]
                    if kind == "ERROR":  # 410 Gone arrives as an event: relist
                        break
                    if kind == "BOOKMARK":
                        continue
                    obj = event["object"]
                    with self._lock:
                        if kind == "DELETED":
                            self._items.pop(obj.metadata.name, None)
                        else:
                            self._items[obj.metadata.name] = obj
            except ApiException as exc:
                self.problem = f"API error {exc.status}: {exc.reason}"
                if exc.status != 410:
                    log.warning("watching %s: %s; relisting", self.what, self.problem)
                    stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                self.problem = f"cannot reach the API server ({type(exc).__name__})"
                log.warning("watching %s: %s; retrying", self.what, self.problem)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # a bug must be seen, and must not end the cache for good
                self.problem = "unexpected error (see the log)"
                log.exception("watching %s failed; relisting", self.what)
                stop.wait(1.0)
            time.sleep(0)  # let a stop land between rounds
