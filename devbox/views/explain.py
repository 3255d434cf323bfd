"""`devbox explain NAME` as text: the autoscaler's verdict on a box, signal by signal. Pure."""

from __future__ import annotations

import time

from devbox.autoscaler import policy
from devbox.autoscaler.state import State
from devbox.units import age


def render(verdict: policy.Verdict, facts: policy.BoxFacts, state: State, *, now: float) -> str:
    box = facts.box
    out = [f"box {box.name} ({box.owner or 'warm pool'}): {verdict.status}: {verdict.why}"]
    for sig in verdict.signals:
        if sig.active_now:
            when = "active now"
        elif sig.last_active:
            when = f"last active {age(now - sig.last_active)} ago"
        else:
            when = "never active"
        out.append(f"  {sig.name:<8} {when:<24} {sig.detail}")
    hang = _hang(verdict, now)
    if hang:
        out.append(f"  {hang}")
    beat = f"{age(now - facts.heartbeat_at)} ago" if facts.heartbeat_at else "never"
    kept = (
        f"until {time.strftime('%a %H:%M', time.localtime(box.keep_until))}"
        if box.keep_until > now
        else "no"
    )
    out.append(f"  heartbeat {beat}; kept: {kept}; claimed {age(now - box.created_at)} ago")
    note = box.autoscaler_note(now)
    if note:
        out.append(f"  {note}")
    return "\n".join(out) + "\n"


def _hang(verdict: policy.Verdict, now: float) -> str:
    """devbox.hang's times as the agent reported them, in human units; "" when neither."""

    def since(t: float) -> str:
        return f"{age(now - t)} (since {time.strftime('%a %H:%M', time.localtime(t))})"

    stalled, hung = verdict.stalled_since, verdict.hung_since
    if hung:
        parts = [f"hung for {since(hung)}"]
        if stalled:
            parts.append(f"stalled for {since(stalled)}")
        return ", ".join(parts) + ": GPUs busy at low power, no probe step, no input"
    if stalled:
        return (
            f"stalled for {since(stalled)}: GPUs busy at low power; not hung unless it "
            "lasts with no probe step and no input"
        )
    return ""
