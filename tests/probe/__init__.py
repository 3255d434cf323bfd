"""Shared by the probe tests: the frameworks must be there (CI installs them), or the run
says why."""

from __future__ import annotations

import importlib.util
import os

import pytest

INSTALLERS = {"torch": "tests.torch_cpu"}  # every other framework: tests.frameworks


def require(*modules: str) -> None:
    """Fail loudly when a framework is missing: a skipped probe test must never read as a
    passed one. DEVBOX_ALLOW_NO_FRAMEWORK=1 (or DEVBOX_ALLOW_NO_TORCH=1, for torch) turns
    the failure into a skip, for a quick local run."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    allowed = os.environ.get("DEVBOX_ALLOW_NO_FRAMEWORK") == "1" or (
        missing == ["torch"] and os.environ.get("DEVBOX_ALLOW_NO_TORCH") == "1"
    )
    if allowed:
        pytest.skip(f"{', '.join(missing)} not installed (DEVBOX_ALLOW_NO_FRAMEWORK=1)")
    installers = sorted({INSTALLERS.get(m, "tests.frameworks") for m in missing})
    pytest.fail(
        f"{', '.join(missing)} not installed: run "
        + " and ".join(f"`python -m {i}`" for i in installers)
        + " (scripts/test does), or set DEVBOX_ALLOW_NO_FRAMEWORK=1 to skip these tests"
    )


def require_torch() -> None:
    require("torch")
