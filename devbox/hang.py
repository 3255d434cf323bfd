"""A hung job from a busy one: the rule, and its pure parts.

A collective that waits forever (an NCCL all-reduce one rank never joins) keeps every GPU
of the job at 100% utilisation, because a spinning kernel is "a kernel running" to NVML,
while the power draw stays near idle, because nothing computes. So utilisation alone
keeps such a box alive for days. The box is *stalled* while every GPU busier than
`util` percent draws under `power` percent of its power limit; it is *hung* once it has
been stalled for `after` seconds with no probe step (devbox.probe reports steps at least
every few seconds while they happen) and no use by a person in that time.

Defaults, from what GPUs report:
- a V100 stuck in an NCCL test: 100% at 44 W of 250 W (18%), idle neighbours 26 W (10%)
  (NVIDIA/nccl#199);
- an H100 idle with 72 GB allocated: 0-2% at 109-134 W of 700 W (16-19%)
  (wilicc/gpu-burn#114), so a spinning H100 sits a little above that;
- training at full utilisation draws well over half the limit; small kernels that keep
  utilisation high at low power exist, which is what `after` and the probe guard against.
So 90% and 30%, for 10 minutes (soperator#796 asks for "N minutes" of these symptoms).

The agent applies the rule to every telemetry sample (agent/activity.py); what it reports
(stalled since, hung since) is what `devbox ls`, the TUI, the autoscaler and its
`explain` read. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from devbox import units
from devbox.errors import UsageError
from devbox.protocol import GpuSample

MAX_AFTER = 366 * 86400.0


@dataclass(frozen=True, kw_only=True)
class Rule:
    util: float = 90.0  # percent: a GPU at least this busy ...
    power: float = 30.0  # ... drawing under this percent of its power limit is stalled
    after: float = 600.0  # seconds stalled, with no probe step and no use: hung

    def check(self, where: str) -> Rule:
        if not 0 < self.util <= 100:  # false for nan too
            raise UsageError(f"{where}: util must be a percentage in (0, 100] (got {self.util:g})")
        if not 0 < self.power < 100:
            raise UsageError(
                f"{where}: power must be a percentage of the power limit in (0, 100) "
                f"(got {self.power:g})"
            )
        if not 0 < self.after <= MAX_AFTER:
            raise UsageError(f"{where}: after must be in (0s, 366d] (got {self.after:g}s)")
        return self

    def agent_args(self) -> list[str]:
        """The agent's options that carry this rule (agent/main.py)."""
        return [
            "--hang-util",
            f"{self.util:g}",
            "--hang-power",
            f"{self.power:g}",
            "--hang-after",
            f"{self.after:g}",
        ]


def parse(table: object, *, where: str) -> Rule:
    """A [hang] table: util and power (percent), after (seconds, or "10m")."""
    if not isinstance(table, Mapping):
        raise UsageError(f"{where} must be a table (util, power, after)")
    unknown = set(table) - {"util", "power", "after"}
    if unknown:
        raise UsageError(f"{where}: unknown setting {sorted(unknown)[0]!r} (util, power, after)")
    values: dict[str, float] = {}
    for key in ("util", "power"):
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UsageError(f"{where}: {key} must be a number, not {value!r}")
            values[key] = float(value)
    if "after" in table:
        after = units.seconds(table["after"])
        if after is None or not math.isfinite(after):
            raise UsageError(
                f"{where}: after must be a duration (600, or 10m), not {table['after']!r}"
            )
        values["after"] = after
    return Rule(**values).check(where)


def stalled(gpus: Sequence[GpuSample], rule: Rule) -> bool:
    """Every GPU at `rule.util` or above draws under `rule.power` of its limit, and there
    is at least one. A GPU that does not report its power is never judged stalled."""
    busy = [g for g in gpus if not g["lost"] and g["util"] is not None and g["util"] >= rule.util]
    if not busy:
        return False
    for g in busy:
        power, limit = g["power_w"], g["power_limit_w"]
        if power is None or not limit or not math.isfinite(power):
            return False
        if power >= limit * rule.power / 100:
            return False
    return True


def power_share(gpus: Sequence[GpuSample]) -> float | None:
    """The busiest share of its power limit any GPU draws (percent), for messages."""
    shares = [
        100 * g["power_w"] / g["power_limit_w"]
        for g in gpus
        if g["power_w"] is not None and g["power_limit_w"]
    ]
    return max(shares) if shares else None


def hung_since(
    *, stalled_since: float, last_step: float, last_use: float, now: float, rule: Rule
) -> float:
    """When the box became hung (unix time), or 0: it has been stalled, with no probe step
    and no use, for `rule.after` seconds."""
    if not stalled_since:
        return 0.0
    became = max(stalled_since, last_step, last_use) + rule.after
    return became if now >= became else 0.0


def describe(box: str, *, since: float, now: float, rule: Rule) -> str:
    """The session's alert, in one line."""
    return (
        f"devbox: box {box} looks hung: its GPUs have been over {rule.util:g}% busy at under "
        f"{rule.power:g}% of their power for {units.age(now - since + rule.after)}, with no "
        f"training step and no input. Where it waits: devbox probe {box} --stacks"
    )
