"""What a test's agent serves besides shells, as agent.main builds it: no sampler runs."""

from __future__ import annotations

from agent.activity import Activity
from agent.services import AgentServices
from agent.tasks import Tasks
from agent.telemetry import Sources, Telemetry


def _no_sources() -> Sources:
    raise AssertionError("this test starts no telemetry sampler")


def bare_services() -> AgentServices:
    activity = Activity(None)
    return AgentServices(
        activity=activity,
        telemetry=Telemetry(box="b", open_sources=_no_sources, activity=activity.snapshot),
        probe_hub=None,
        tasks=Tasks(),
    )
