"""Save before release. When the box is being ended (`devbox down`, the autoscaler, a pod
deleted by anyone, a node drained), the agent asks every probed process that registered
probe.on_release (or polls probe.release_requested) to save, waits for each answer or for
the release's limit, tells the session what was saved, and publishes it for whoever
released the box; only then are the sessions and their processes ended.

The limit comes from the release itself: a local box's release file (written by the
backend before it signals the keeper, which waits for the agent that long), or a pod's
deletion grace period (the kubelet waits that long before it kills the container). The
request and result formats are devbox.saves."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from agent.probehub import ProbeHub
from devbox import saves, units
from devbox.protocol import SaveResult

log = logging.getLogger("devbox.agent")


async def save_before_release(
    hub: ProbeHub | None,
    *,
    box: str,
    deadline: float,
    reason: str,
    tell: Callable[[str], Awaitable[object]],
    publish: Callable[[list[SaveResult]], Awaitable[object]],
) -> list[SaveResult]:
    """Ask, wait, tell, publish. Never raises: a release goes on whatever the saves do."""
    if hub is None or not hub.processes:
        return []
    left = deadline - time.time()
    if left <= 0:
        log.info("released without a save: the release left no time (--now)")
        return []
    asking = (
        f"devbox: box {box} is being released ({reason or 'ended'}): asking its probed "
        f"processes to save (at most {units.age(left)})"
    )
    await _quietly(tell(asking))
    try:
        results = await hub.release(reason=reason, deadline=deadline)
    except Exception:  # the hub is ours, but a release must never stop on it
        log.exception("the save before release failed")
        return []
    said = [saves.line(r) for r in results]
    for line in said:
        log.info("%s", line)
    if results:
        await _quietly(tell(f"devbox: box {box}: " + "; ".join(said)))
        await _quietly(publish(results))
    return results


async def _quietly(step: Awaitable[object]) -> None:
    try:
        await step
    except Exception as exc:
        log.warning("after the saves: %s", exc)
