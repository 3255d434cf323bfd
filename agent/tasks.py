"""Long-lived work the agent starts and must not lose track of (kopf's guarded tasks): each
is named, held (asyncio keeps only a weak reference to a task), and its failure is logged
with that name instead of vanishing with the task or the executor's future."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("devbox.agent.tasks")


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `coro` until it ends or `cancel_all`; a crash is logged as `name`'s."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._hold(task, name)
        return task

    def offload(self, name: str, call: Callable[..., Any], *args: Any) -> None:
        """Run a blocking `call(*args)` (an API request) in a thread, off the event loop;
        fire and forget, except that a failure is logged as `name`'s."""
        future = asyncio.get_running_loop().run_in_executor(None, call, *args)
        self._hold(future, name)

    def _hold(self, future: asyncio.Future[Any], name: str) -> None:
        self._running.add(future)

        def done(f: asyncio.Future[Any]) -> None:
            self._running.discard(f)
            if not f.cancelled() and (exc := f.exception()) is not None:
                log.error("%s failed: %s: %s", name, type(exc).__name__, exc)

        future.add_done_callback(done)

    async def cancel_all(self) -> None:
        """End every task still running (the agent is stopping) and wait for them."""
        running = list(self._running)
        for future in running:
            future.cancel()
        await asyncio.gather(*running, return_exceptions=True)
