"""The dashboard's model screen against a real box: torch training with devbox.probe in a
local box, the agent's hub, and the app's BackendFeed over SSH; what the screen holds
matches the statistics computed directly in the training process."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Static

from devbox.backends.local import LocalBackend
from devbox.config import Config
from tests.conftest import REPO, User
from tests.probe import require_torch
from tests.tui.test_app import until
from tests.tui.test_real_boxes import as_user  # noqa: F401  (a fixture)
from tui.app import make_app
from tui.feed import ModelView
from tui.screens.model import ModelScreen


@pytest.fixture(autouse=True)
def _torch() -> None:
    require_torch()


async def test_the_model_screen_shows_a_real_training_run(as_user: User) -> None:  # noqa: F811
    user = as_user
    user.up("tuiprobe")
    ref = user.home / "ref.jsonl"
    train = f"{sys.executable} {REPO / 'tests/probe/train.py'} --ref {ref} --every 4"
    out = user.devbox(
        "ssh", "tuiprobe", "--", f"setsid {train} >/dev/null 2>&1 </dev/null & echo $!", check=True
    )
    pid = int(out.stdout)
    try:
        app = make_app(backend=LocalBackend(config=Config()), rate=2.0, list_interval=0.5)
        async with app.run_test(size=(160, 45)) as pilot:
            await until(lambda: "tuiprobe" in app.store.views, timeout=30)
            app.open_model("tuiprobe")
            await until(lambda: isinstance(app.screen, ModelScreen) and app.screen.query("#layers"))
            models = app.store.models
            await until(lambda: pid in models.get("tuiprobe", _NONE).stats, timeout=60)
            report = models["tuiprobe"].stats[pid]
            # The summary names what the probe hooks, then the command.
            summary = app.screen.query_one("#model-summary", Static)
            await until(lambda: f"pid {pid} step" in str(summary.render()))
            assert "[torch] " in str(summary.render())
            await until(lambda: report["step"] in _steps(ref), timeout=30)
            want = _steps(ref)[report["step"]]["layers"]
            for stats in report["layers"]:
                for key in ("act_mean", "act_std", "grad_norm", "weight_norm", "update_ratio"):
                    expected = want[stats["name"]].get(key)
                    got = stats[key]
                    if expected is None:
                        assert got is None
                    else:
                        assert got is not None, key
                        assert math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-6), key
            table = app.screen.query_one("#layers", DataTable)
            await until(lambda: table.row_count == 5)
            # The selected (first) layer's histogram comes from the training process.
            await until(lambda: len(models["tuiprobe"].histograms) > 0, timeout=30)
            _step, counts, low, high = models["tuiprobe"].histograms[-1]
            assert sum(counts) == 64 * 32 and low < high
            await pilot.press("escape")
    finally:
        os.kill(pid, signal.SIGKILL)


_NONE = ModelView()


def _steps(ref: Path) -> dict[int, dict[str, Any]]:
    text = ref.read_text() if ref.exists() else ""
    rows = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
    return {int(r["step"]): r for r in rows}
