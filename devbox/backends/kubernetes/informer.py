"""A list-watch cache of one kind of object: the autoscaler reads this, never the API
server, so a reconcile pass costs no request per box (or any read at all)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from devbox.backends.kubernetes.rest import ApiError, Rest
from devbox.backends.kubernetes.watching import LISTED, list_then_watch
from devbox.errors import DevboxError

log = logging.getLogger("devbox.autoscaler.informer")


class Informer:
    """Objects of the collection at `path` matching `selector` (labels) and `fields`,
    kept current by a watch. The watch resumes after whatever ends it
    (watching.list_then_watch)."""

    def __init__(
        self, what: str, rest: Rest, path: str, *, selector: str = "", fields: str = ""
    ) -> None:
        self.what = what
        self._rest, self._path, self._selector, self._fields = rest, path, selector, fields
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

    def settle(self, timeout: float) -> None:
        """Until the first list, or a problem with it (a cache that may be forbidden)."""
        deadline = time.monotonic() + timeout
        while not self.synced.wait(0.05) and self.problem is None:
            if time.monotonic() > deadline:
                return

    def _run(self, stop: threading.Event) -> None:
        def problem(text: str) -> None:
            self.problem = text
            log.warning("watching %s: %s; relisting", self.what, text)

        while not stop.is_set():
            try:
                for kind, payload in list_then_watch(
                    lambda: (self._rest, self._path),
                    self._selector,
                    stop,
                    fields=self._fields,
                    timeout_seconds=60,
                    on_problem=problem,
                ):
                    with self._lock:
                        if kind == LISTED:
                            self._items = {_key(x): x for x in payload}
                        elif kind == "DELETED":
                            self._items.pop(_key(payload), None)
                        else:
                            self._items[_key(payload)] = payload
                    if kind == LISTED:
                        self.problem = None
                        self.synced.set()
            except ApiError as exc:  # 401/403: the autoscaler's RBAC is wrong
                problem(f"forbidden or unauthorised ({exc.status}): {exc.message}")
                stop.wait(5.0)
            except Exception:  # a bug must be seen, and must not end the cache for good
                self.problem = "unexpected error (see the log)"
                log.exception("watching %s failed; relisting", self.what)
                stop.wait(1.0)


def _key(obj: dict[str, Any]) -> str:
    """Namespace and name: a collection of every namespace holds names twice."""
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"
