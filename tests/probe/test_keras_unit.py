"""The Keras 3 probe on the JAX and PyTorch backends, with a fake agent: one process per
backend runs tests/probe/keras_scenarios.py (Keras takes its backend once per process), and
these tests read what it recorded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.probe import require

BACKENDS = ["jax", "torch"]


@pytest.fixture(scope="module", params=BACKENDS)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    backend = request.param
    require("keras", backend)
    out = tmp_path_factory.mktemp(backend) / "scenarios.json"
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.probe.keras_scenarios", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recorded: dict[str, Any] = json.loads(Path(out).read_text())
    recorded["backend"] = backend
    return recorded


def _close(got: float | None, want: float | None) -> bool:
    if want is None or not math.isfinite(want):
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6)


def test_observed_steps_match_a_direct_computation(run: dict[str, Any]) -> None:
    s = run["statistics"]
    assert s["hello"]["framework"] == f"keras/{run['backend']}"
    assert s["hello"]["layers"] == ["dense", "dense_1", "dense_2"]
    assert [r["step"] for r in s["reports"]] == [0, 2, 4]  # every=2 while watched
    for report in s["reports"]:
        want = s["reference"][report["step"]]["layers"]
        assert [layer["name"] for layer in report["layers"]] == list(want)
        for stats in report["layers"]:
            for key, value in want[stats["name"]].items():
                ok = stats[key] == value if key == "act_nan" else _close(stats[key], value)
                assert ok, (report["step"], stats["name"], key, stats[key], value)
            assert stats["grad_nan"] == 0 and stats["act_inf"] == 0
        assert report["layers"][0]["act_zeros"] > 0 and report["alerts"] == []  # relu


def test_only_observed_steps_leave_keras_own_train_function(run: dict[str, Any]) -> None:
    # Watched: the steps between reports run Keras's function, keeping its loss (the check).
    s = run["statistics"]
    assert s["kinds"] == ["observed", "checking"] * 3
    assert s["normal_after"]  # fit's end gives the model its own function back


def test_requests_are_answered_with_the_right_numbers(run: dict[str, Any]) -> None:
    s = run["statistics"]
    replies = {r["id"]: r for r in s["replies"]}
    assert all(r["step"] == 0 and "error" not in r for r in replies.values()), replies
    for key in ("1", "3"):  # histograms: the activation of dense, dense_2's gradient
        counts, low, high = s["direct"][key]
        reply = replies[int(key)]
        assert sum(reply["counts"]) == sum(counts) and len(reply["counts"]) == len(counts)
        # float32 against float64: a value on a bin's edge may fall either side.
        assert all(abs(a - b) <= 1 for a, b in zip(reply["counts"], counts, strict=True))
        assert reply["low"] == pytest.approx(low, abs=1e-6)
        assert reply["high"] == pytest.approx(high, rel=1e-5)
    assert sum(replies[1]["counts"]) == 64 * 32
    for key in ("2", "4"):  # summaries: dense_1's weights before the step, its activation
        want, got = s["direct"][key], replies[int(key)]
        assert got["shape"] == want["shape"] and got["nan"] == want["nan"] == 0
        for stat in ("mean", "std", "min", "max", "norm"):
            assert got[stat] == pytest.approx(want[stat], rel=1e-4, abs=1e-6), (key, stat)
    assert replies[2]["shape"] == [32 * 16 + 16] and replies[4]["shape"] == [64, 16]


def test_an_injected_nan_raises_the_alert_within_one_report(run: dict[str, Any]) -> None:
    stats = run["nan"]["stats"]
    # The check of the poisoned step itself (every=10: it is not a report step).
    checks = [f for f in stats if f["alerts"] and not f["layers"]]
    assert min(f["step"] for f in checks) == 3, stats
    assert all(f["alerts"][0]["kind"] == "nan" for f in checks)
    # The check forces a report of the next step, which says which layer: the first
    # outputs NaN. (The scenario's loop waits for each step's loss, as a progress bar does;
    # the probe itself never waits for the device.)
    report = next(f for f in stats if f["layers"] and f["step"] > 3)
    assert report["step"] == 4, [f["step"] for f in stats]  # not the due one (every=10)
    assert report["layers"][0]["act_nan"] > 0 and report["layers"][0]["act_mean"] is None
    assert any(a["layer"] == "dense" for a in report["alerts"])


def test_layers_are_chosen_by_name_and_bad_input_is_refused(run: dict[str, Any]) -> None:
    s = run["selection"]
    assert s["one"] == ["dense_1"] and s["many"] == ["dense", "dense_1", "dense_2"]
    assert s["nested"] == ["inner/a", "b"] and s["nested_inner"] == ["inner"]
    assert s["bad_pattern"] == (
        "ValueError: devbox.probe: no layer matches ['nope*'] (layers: dense, dense_1, dense_2)"
    )
    assert s["a_layer"].startswith("TypeError: devbox.probe.watch needs a keras.Model")
    assert s["an_object"].startswith("TypeError: devbox.probe.watch needs a torch.nn.Module")


def test_a_failure_of_the_probe_switches_it_off_and_training_goes_on(run: dict[str, Any]) -> None:
    s = run["broken"]
    assert s["off"] and s["normal_after"] and math.isfinite(s["loss"])
    assert s["logged"] == ["devbox.probe failed and is now off; training goes on"]


def test_a_save_at_a_step_boundary_reads_the_trained_weights(run: dict[str, Any]) -> None:
    # On JAX, Keras keeps the weights in its own state during an epoch: the probe syncs
    # them into the variables before the save runs.
    s = run["release_sync"]
    assert s["saves"] == 1 and s["kernel_ok"] and s["shape"] == [8, 32]
