"""Counts the box's running `devbox run` experiments for the activity record: a training run
with nobody typing must still keep the box from being released as idle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from agent.activity import Activity
from devbox.runs.record import count_running

log = logging.getLogger("devbox.agent")

# As often as `devbox ls` and the autoscaler could notice; a count is a listdir and a
# flock probe per running run, nothing more.
INTERVAL_SECONDS = 2.0


async def watch(
    activity: Activity, runs_dir: Callable[[], Path], *, interval: float = INTERVAL_SECONDS
) -> None:
    """runs_dir is asked each time: a warm pod's home is known only once it is claimed."""
    while True:
        try:
            activity.set_runs(count_running(runs_dir()))
        except OSError:
            log.exception("counting the box's runs failed")
        await asyncio.sleep(interval)
