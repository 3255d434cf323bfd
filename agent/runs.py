"""Counts the box's running `devbox run` experiments for the activity record: a training run
with nobody typing must still keep the box from being released as idle."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from agent.activity import Activity
from devbox.runs.record import count_running

log = logging.getLogger("devbox.agent")


def note(activity: Activity, runs_dir: Callable[[], Path]) -> None:
    """Count them into `activity`: a listdir and a flock probe per running run, nothing
    more. Called with each telemetry sample rather than by a timer of its own, so a quiet
    box wakes only for its slow ticks (a run that starts is a command started: use, which
    brings the sampler's full rate back at once). runs_dir is asked each time: a warm
    pod's home is known only once it is claimed."""
    try:
        activity.set_runs(count_running(runs_dir()))
    except OSError:
        log.exception("counting the box's runs failed")
