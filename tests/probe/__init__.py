"""Shared by the probe tests: torch must be there (CI installs it), or the run says why."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_torch() -> None:
    """Fail loudly without torch: a skipped probe test must never read as a passed one.
    DEVBOX_ALLOW_NO_TORCH=1 turns the failure into a skip, for a quick local run."""
    if importlib.util.find_spec("torch") is not None:
        return
    if os.environ.get("DEVBOX_ALLOW_NO_TORCH") == "1":
        pytest.skip("torch is not installed (DEVBOX_ALLOW_NO_TORCH=1)")
    pytest.fail(
        "torch is not installed: run `python -m tests.torch_cpu` (scripts/test does), "
        "or set DEVBOX_ALLOW_NO_TORCH=1 to skip the probe tests"
    )
