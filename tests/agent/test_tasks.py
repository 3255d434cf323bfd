"""The agent's long-lived work is held and named: a crash is logged as that work's, never
lost with the task or an executor's future, and stopping the agent ends what is left."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.tasks import Tasks


def test_a_crashed_task_and_a_failed_offloaded_call_are_logged_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def crash() -> None:
        raise RuntimeError("NVML went away")

    def refused(what: str) -> None:
        raise PermissionError(f"pods is forbidden: {what}")

    async def main() -> None:
        tasks = Tasks()
        task = tasks.spawn("telemetry", crash())
        await asyncio.gather(task, return_exceptions=True)
        tasks.offload("publish alerts", refused, "patch")
        # The offloaded call ends in a thread; its done callback runs on the loop after.
        for _ in range(200):
            if "publish alerts failed" in caplog.text:
                break
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="devbox.agent.tasks"):
        asyncio.run(main())
    assert "telemetry failed: RuntimeError: NVML went away" in caplog.text
    assert "publish alerts failed: PermissionError: pods is forbidden: patch" in caplog.text


def test_cancel_all_ends_what_still_runs_and_logs_no_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = []

    async def forever() -> None:
        started.append(True)
        await asyncio.Event().wait()

    async def main() -> asyncio.Task[None]:
        tasks = Tasks()
        task = tasks.spawn("runs", forever())
        await asyncio.sleep(0)
        await tasks.cancel_all()
        return task

    with caplog.at_level(logging.ERROR, logger="devbox.agent.tasks"):
        task = asyncio.run(main())
    assert started and task.cancelled()
    assert "failed" not in caplog.text
