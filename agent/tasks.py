"""The agent's background tasks, started in one place (kopf's create_guarded_task).

The event loop keeps only a weak reference to a task: one nobody holds can vanish in the
middle of its work, and one that fails says so only when it is collected, if ever. A task
spawned here is held until it ends, carries a name, and its failure is logged under that
name at once; the agent cancels and awaits those still running when it shuts down."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("devbox.agent.tasks")


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def spawn(
        self, name: str, coro: Coroutine[Any, Any, object], *, forever: bool = False
    ) -> asyncio.Task[Any]:
        """Run `coro` as a task named `name`. `forever`: it runs until cancelled, so its
        return is a fault and is logged as one."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._running.add(task)
        task.add_done_callback(functools.partial(self._ended, forever=forever))
        return task

    def _ended(self, task: asyncio.Task[Any], *, forever: bool) -> None:
        self._running.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: asyncio does not report it a second time
        if exc is not None:
            log.error("task %s failed: %s", task.get_name(), exc, exc_info=exc)
        elif forever:
            log.error("task %s ended, and it should run as long as the agent", task.get_name())

    async def close(self) -> None:
        """Cancel every task still running and wait until each has ended."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
