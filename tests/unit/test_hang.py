"""devbox.hang, pure: the rule and its checks, a stall judged per sample, when a box is
hung, and the agent's Activity applying it sample by sample (with a fake clock: the
samples' own times)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.activity import Activity
from devbox import config, hang, protocol
from devbox.errors import UsageError

RULE = hang.Rule(util=90, power=30, after=60)


def gpu(util: float | None, power: float | None, limit: float | None = 700.0, **kw: Any) -> Any:
    return {"util": util, "power_w": power, "power_limit_w": limit, "lost": False, **kw}


def sample(t: float, *gpus: Any) -> Any:
    return {"t": t, "seq": 1, "gpus": list(gpus), "host": {}, "processes": []}


@pytest.mark.parametrize(
    ("gpus", "stalled"),
    [
        ([gpu(100, 150)], True),  # 21% of 700 W
        ([gpu(100, 150), gpu(100, 180)], True),
        ([gpu(100, 150), gpu(100, 400)], False),  # one computes: progress somewhere
        ([gpu(100, 150), gpu(0, 60)], True),  # an idle GPU beside a stuck one
        ([gpu(50, 100)], False),  # not busy enough to look stuck
        ([gpu(0, 60)], False),  # idle is idle, not hung
        ([gpu(100, None)], False),  # no power figure: never judged
        ([gpu(100, 150, limit=None)], False),
        ([gpu(None, 150)], False),
        ([gpu(100, 150, lost=True)], False),
        ([], False),  # no GPUs: a CPU box is never hung by this rule
        ([gpu(100, 210)], False),  # exactly 30%: not under it
    ],
)
def test_a_sample_is_stalled_when_every_busy_gpu_draws_little(gpus: Any, stalled: bool) -> None:
    assert hang.stalled(gpus, RULE) is stalled


def test_hung_once_stalled_without_a_step_or_use_for_after() -> None:
    def since(**kw: float) -> float:
        base = {"stalled_since": 1000.0, "last_step": 0.0, "last_use": 0.0, "now": 1059.0}
        return hang.hung_since(**{**base, **kw}, rule=RULE)

    assert since() == 0.0  # 59 s stalled: not yet
    assert since(now=1060.0) == 1060.0
    assert since(now=5000.0) == 1060.0  # hung since then, not since now
    assert since(now=5000.0, last_step=1500.0) == 1560.0  # a step restarts the count
    assert since(now=1100.0, last_step=1090.0) == 0.0
    assert since(now=1100.0, last_use=1090.0) == 0.0  # a person at work: not hung
    assert since(stalled_since=0.0, now=9999.0) == 0.0


def test_the_agent_judges_sample_by_sample_and_says_so_once(tmp_path: Path) -> None:
    told: list[float] = []
    activity = Activity(tmp_path / "activity.json", rule=RULE, last_input=0.0)
    activity.on_hung = told.append
    for t in range(1000, 1061, 1):
        activity.observe(sample(float(t), gpu(100, 150)))
    assert activity.stalled_since == 1000.0 and activity.hung_since == 1060.0
    assert told == [1060.0]
    activity.observe(sample(1061.0, gpu(100, 150)))
    assert told == [1060.0]  # said once per hang
    snap = json.loads((tmp_path / "activity.json").read_text())
    assert snap["hung_since"] == 1060.0 and snap["stalled_since"] == 1000.0
    # Power comes back: not stalled, not hung, and the session hears nothing more.
    activity.observe(sample(1062.0, gpu(100, 500)))
    assert activity.stalled_since == 0.0 and activity.hung_since == 0.0 and told[-1] == 0.0
    # A probe step during a stall keeps the box busy.
    for t in range(2000, 2200, 1):
        if t % 20 == 0:
            activity.last_probe = float(t)
        activity.observe(sample(float(t), gpu(100, 150)))
    assert activity.stalled_since == 2000.0 and activity.hung_since == 0.0


def test_the_rule_is_validated_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[hang]\nutil = 95\npower = 25\nafter = "15m"\n')
    assert config.load(path).hang == hang.Rule(util=95, power=25, after=900)
    assert config.load(tmp_path / "none.toml").hang == hang.Rule()
    bad = {
        "util = 0": "util must be a percentage in (0, 100] (got 0)",
        "util = 101": "util must be a percentage in (0, 100] (got 101)",
        "power = 100": "power must be a percentage of the power limit in (0, 100) (got 100)",
        'power = "low"': "power must be a number, not 'low'",
        "after = 0": "after must be in (0s, 366d] (got 0s)",
        'after = "soon"': "after must be a duration (600, or 10m), not 'soon'",
        "after = nan": "after must be a duration (600, or 10m), not nan",
        "when = 3": "unknown setting 'when' (util, power, after)",
    }
    for line, message in bad.items():
        path.write_text(f"[hang]\n{line}\n")
        with pytest.raises(UsageError) as caught:
            config.load(path)
        assert caught.value.message == f"config file {path}: [hang]: {message}", line
    path.write_text("hang = 3\n")
    with pytest.raises(UsageError, match=r"\[hang\] must be a table"):
        config.load(path)


def test_the_rule_travels_to_the_agent_as_its_options() -> None:
    from agent.main import _check, _parser

    argv = ["--host-key", "/k", "--name", "b", "--home", "/h", "--authorized-key", "/a"]
    args = _parser().parse_args([*argv, *RULE.agent_args()])
    _check(args)
    assert args.hang == RULE
    assert protocol.ANN_HUNG_SINCE in protocol.activity_annotations(
        {"last_input": 0.0, "clients": 0, "hung_since": 5.0}
    )
    from agent.main import StartError

    bad = _parser().parse_args([*argv, "--hang-power", "0"])
    with pytest.raises(StartError, match=r"--hang-\*: power must be a percentage"):
        _check(bad)
