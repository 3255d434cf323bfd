"""Save before release, the parts both sides share: the release request a local box's
backend writes for its agent and keeper, the results the agent publishes (a local box's
file, a pod's annotation), and how a result reads. Pure; the agent's side is
agent/saving.py.

A release gives the box's probed processes `limit` seconds to save, plus MARGIN for the
agent to tell the session, publish what was saved and end the sessions."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from devbox import protocol
from devbox.protocol import SaveResult

MARGIN = 8.0
MAX_LIMIT = 3600.0


@dataclass
class Ask:
    """A release's request that the box's probed processes save first: how long they get
    and why the box goes (what probe.on_release is told). The backend fills `results`
    with what each answered, once the box is gone."""

    within: float
    reason: str = "down"
    results: list[SaveResult] = field(default_factory=list)


def request(limit: float, reason: str, *, now: float | None = None) -> str:
    """A local box's release file: how long its processes may take, and why it goes."""
    at = time.time() if now is None else now
    return json.dumps({"limit": limit, "reason": reason, "at": at})


def read_request(text: str) -> tuple[float, str]:
    """(deadline, reason) of a release file; (0, "") when it is malformed, and a deadline
    of 0 when the release left no time (--now)."""
    try:
        data = json.loads(text)
        limit, reason, at = float(data["limit"]), str(data.get("reason", "")), float(data["at"])
    except (ValueError, KeyError, TypeError):
        return 0.0, ""
    if not (limit > 0 and math.isfinite(at)):  # nan too
        return 0.0, reason
    return at + min(limit, MAX_LIMIT), reason


def line(r: SaveResult) -> str:
    """One process's part, as the session, the agent's log and `devbox down` say it."""
    who = f"process {r['pid']}" + (f" ({r['cmd'][:60]})" if r["cmd"] else "")
    if r["status"] == "saved":
        return f"{who} saved {', '.join(r['saved']) or 'what it saves (it named nothing)'}"
    return f"{who}: not saved: {r['detail'] or r['status']}"


def encode(results: list[SaveResult], *, most: int = 8192) -> str:
    """The results as JSON for a pod annotation, at most `most` bytes: what each saved is
    dropped from the last process backwards (an annotation is no log)."""
    kept = [SaveResult(**r) for r in results]
    text = json.dumps(kept)
    while len(text) > most and any(r["saved"] for r in kept):
        last = next(r for r in reversed(kept) if r["saved"])
        last["saved"] = last["saved"][:-1]
        text = json.dumps(kept)
    return text if len(text) <= most else "[]"


def decode(text: str) -> list[SaveResult]:
    """Inverse of encode; [] for anything malformed (a file or an annotation others
    could have edited is read, never trusted to be well-formed)."""
    try:
        return protocol.save_results(json.loads(text))
    except (ValueError, TypeError, RecursionError):
        return []
