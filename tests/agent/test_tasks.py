"""The agent's guarded tasks: a long-lived loop that dies says so, by name, at once; one
that is cancelled does not; and shutdown ends every task still running."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.tasks import Tasks


async def test_a_failing_task_is_logged_by_name_and_shutdown_cancels_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="devbox.agent.tasks")
    tasks = Tasks()
    cancelled = asyncio.Event()

    async def breaks() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the watch broke")

    async def runs_on() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    broken = tasks.spawn("pod-watch", breaks(), forever=True)
    kept = tasks.spawn("sampler", runs_on(), forever=True)
    await asyncio.wait({broken})  # its done callback, registered first, has run by now
    (failed,) = caplog.records
    assert failed.levelno == logging.ERROR
    assert "pod-watch" in failed.getMessage() and "the watch broke" in failed.getMessage()
    assert failed.exc_info is not None and failed.exc_info[0] is RuntimeError

    await tasks.close()
    assert cancelled.is_set() and kept.cancelled()
    assert len(caplog.records) == 1  # a cancellation at shutdown is no failure


async def test_only_a_task_meant_to_run_forever_is_faulted_for_returning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="devbox.agent.tasks")
    tasks = Tasks()
    loop_task = tasks.spawn("runs", asyncio.sleep(0), forever=True)
    one_call = tasks.spawn("annotate", asyncio.sleep(0))
    await asyncio.wait({loop_task, one_call})
    (ended,) = caplog.records
    assert ended.levelno == logging.ERROR and "runs" in ended.getMessage()
    await tasks.close()
