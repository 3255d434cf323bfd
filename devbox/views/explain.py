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
