"""Polling for a condition that real processes make true in their own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    check: Callable[[], Any], timeout: float = 10.0, what: str = "condition", every: float = 0.05
) -> Any:
    """The first truthy value `check` returns; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
