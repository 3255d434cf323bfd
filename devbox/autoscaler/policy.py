"""The autoscaler's policy: pure functions from boxes, their activity and the time to
actions. No I/O and no clock of its own, so every rule is unit-tested with a fake clock.

A box is in use while any enabled signal is active: SSH input, attached clients, GPU
utilisation or the box's CPU above a threshold, probe batches from a training loop,
`devbox run` experiments. Two of them are times the agent reports (last input, last probe
batch); the others are states ("3 clients now"), so the loop remembers when each was last
seen active (`Memory`, which it persists: a restart forgets nothing).

A box its agent reports hung (devbox.hang: busy GPUs at low power, no probe step, no input)
looks busy to those state signals for as long as the hang lasts. With `hung = "release"` they
stop counting for it: the box is warned and released `hung_grace` after the hang began (or
after a person last used it, if later), unless the usual idle rule releases it first. With
`hung = "report"` it is only shown as hung.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from devbox.autoscaler import pool
from devbox.autoscaler.config import Settings
from devbox.autoscaler.pool import CreateWarm as CreateWarm
from devbox.autoscaler.pool import DropStale as DropStale
from devbox.autoscaler.pool import PendingPod as PendingPod
from devbox.autoscaler.pool import WarmPod as WarmPod
from devbox.autoscaler.pool import Yield as Yield
from devbox.boxes import Box, BoxState
from devbox.protocol import TRAFFIC_FLOOR, TRAFFIC_WINDOW, Activity
from devbox.units import age as _span

# The metrics count a box as idle (its GPUs wasted) after this long with every signal quiet.
IDLE_AFTER = 60.0
_NOW_SIGNALS = ("clients", "gpu", "cpu", "runs")
# Traffic signals: the Activity key the agent reports each in, and what it counts.
_TRAFFIC = {
    "forwards": ("last_forward", "port-forward traffic"),
    "sftp": ("last_sftp", "SFTP/scp transfers"),
    "stdin": ("last_exec", "input to commands"),
}
_FLOOR = f"at least {TRAFFIC_FLOOR // 1024} KiB in {TRAFFIC_WINDOW:g} s"
# A person's use and a training step are real even on a hung box (the agent ends the hang
# on either); the state signals are what a hung job keeps "active".
_PERSON_SIGNALS = ("input", "forwards", "sftp", "stdin", "probe")
_NOT_USE = "not use: the box is hung"
_HANG = "GPUs busy at low power, no probe step, no input (devbox.hang)"

Memory = dict[str, dict[str, float]]  # box key -> signal -> when last seen active


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoxFacts:
    """One box as the loop found it: its record, its agent's newest report and when that
    report was made (0: never)."""

    key: str  # what actions address: the pod, or the local box's name
    box: Box
    activity: Activity | None = None
    heartbeat_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class Signal:
    name: str
    last_active: float  # 0: never seen active
    active_now: bool
    detail: str  # "3 clients attached", "GPU 2% (threshold 5%)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """Why a box is alive (or is going): what `devbox explain` and the logs say."""

    key: str
    box: str
    owner: str
    # busy, idle, hung, warned, kept, new, unhealthy, releasing, deferred, not-running
    status: str
    why: str
    signals: tuple[Signal, ...] = ()
    idle_since: float = 0.0
    gpus: int = 0
    # devbox.hang's times as the box's (healthy) agent reports them; 0: not now.
    stalled_since: float = 0.0
    hung_since: float = 0.0


@dataclasses.dataclass(frozen=True)
class Warn:
    key: str
    box: str
    owner: str
    release_at: float
    reason: str  # "idle", "lifetime" or "hung"
    why: str


@dataclasses.dataclass(frozen=True)
class Unwarn:
    key: str
    box: str
    owner: str
    why: str


@dataclasses.dataclass(frozen=True)
class Release:
    key: str
    box: str
    owner: str
    reason: str  # "idle", "lifetime", "hung" or "unhealthy"
    why: str
    # Seconds the box's probed processes get to save first (devbox.saves): the settings'
    # save_timeout; 0 for a silent agent, which could not ask them.
    save_within: float = 0.0


@dataclasses.dataclass(frozen=True)
class MarkUnhealthy:
    key: str
    box: str
    owner: str
    since: float
    why: str


@dataclasses.dataclass(frozen=True)
class MarkHealthy:
    key: str
    box: str
    owner: str
    why: str


Action = Warn | Unwarn | Release | MarkUnhealthy | MarkHealthy | CreateWarm | Yield | DropStale


@dataclasses.dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    verdicts: tuple[Verdict, ...]
    # What the policy could not do, in words for the log (a pool of an unknown profile).
    notes: tuple[str, ...] = ()


# --- memory of the signals that are states -------------------------------------------


def observe(memory: Memory, facts: Iterable[BoxFacts], settings: Settings) -> Memory:
    """The memory after this pass's reports: a state signal active in a report was active
    when that report was made. Boxes that are gone are forgotten."""
    out: Memory = {}
    for f in facts:
        seen = dict(memory.get(f.key, {}))
        if f.activity is not None and f.heartbeat_at:
            for name in _NOW_SIGNALS:
                if _active_now(name, f.activity, settings):
                    seen[name] = max(seen.get(name, 0.0), f.heartbeat_at)
        out[f.key] = seen
    return out


def _active_now(name: str, a: Activity, s: Settings) -> bool:
    if name == "clients":
        return a["clients"] > 0
    if name == "runs":
        return a.get("runs", 0) > 0
    if name == "gpu":
        util = a.get("gpu_util")
        return util is not None and util >= s.gpu_util_threshold
    if name == "cpu":
        cpu = a.get("cpu")
        return cpu is not None and cpu >= s.cpu_threshold
    return False


def hang_times(a: Activity | None) -> tuple[float, float]:
    """(stalled since, hung since) as the agent reports them; 0 for not now, and for a
    value no clock could have written (a bad annotation: nan, inf, negative)."""

    def one(key: str) -> float:
        value = float(cast(Mapping[str, float], a).get(key) or 0.0) if a else 0.0
        return value if math.isfinite(value) and value > 0 else 0.0

    return one("stalled_since"), one("hung_since")


def signals(f: BoxFacts, memory: Memory, settings: Settings) -> tuple[Signal, ...]:
    a, seen = f.activity, memory.get(f.key, {})
    # With hung = "release", what a hung job keeps active says so (it does not keep the box).
    hung = settings.hung == "release" and hang_times(a)[1] > 0
    out = []
    for name in settings.signals:
        if name == "input":
            last = a["last_input"] if a else 0.0
            out.append(Signal(name, last, False, "terminal keys and commands"))
        elif name in _TRAFFIC:
            key, what = _TRAFFIC[name]
            last = float(cast(Mapping[str, float], a).get(key) or 0.0) if a else 0.0
            out.append(Signal(name, last, False, f"{what} ({_FLOOR})"))
        elif name == "probe":
            last = a.get("last_probe", 0.0) if a else 0.0
            out.append(Signal(name, last, False, "probe batches"))
        else:
            now = a is not None and _active_now(name, a, settings)
            detail = _detail(name, a, settings)
            if hung and now:
                detail = f"{detail}; {_NOT_USE}"
            out.append(Signal(name, seen.get(name, 0.0), now, detail))
    return tuple(out)


def _detail(name: str, a: Activity | None, s: Settings) -> str:
    if a is None:
        return "not reported"
    if name == "clients":
        return f"{a['clients']} client(s) attached"
    if name == "runs":
        return f"{a.get('runs', 0)} run(s) going"
    if name == "gpu":
        util = a.get("gpu_util")
        shown = "no GPU figure" if util is None else f"{util:.0f}%"
        return f"GPU {shown} (threshold {s.gpu_util_threshold:g}%)"
    cpu = a.get("cpu")
    shown = "unknown" if cpu is None else f"{cpu:.0f}%"
    return f"CPU {shown} of a core (threshold {s.cpu_threshold:g}%)"


# --- the decision ------------------------------------------------------------------------


def decide(
    facts: Sequence[BoxFacts],
    *,
    memory: Memory,
    now: float,
    settings: Settings,
    warm: Mapping[tuple[str, int], int] | None = None,
    warm_pods: Sequence[WarmPod] = (),
    pending: Sequence[PendingPod] = (),
    profiles: Mapping[str, int] | None = None,
    largest_node_gpus: int | None = None,
) -> Decision:
    """This pass's actions and a verdict per box. `warm` counts unclaimed warm pods of
    the current shape per (profile, GPUs); `warm_pods`, `pending` and `profiles` are the
    facts the pools' rules (devbox.autoscaler.pool) need."""
    actions: list[Action] = []
    verdicts: list[Verdict] = []
    due: list[tuple[float, Release, Verdict]] = []
    for f in facts:
        verdict, box_actions, release = _one(f, memory, now, settings)
        actions.extend(box_actions)
        if release is None:
            verdicts.append(verdict)
        else:
            due.append((release[0], release[1], verdict))
    # Longest overdue first; the rest wait for the next pass (a bad config or a mass idle
    # must not empty the cluster at once).
    due.sort(key=lambda d: (d[0], d[1].key))
    for i, (_, action, verdict) in enumerate(due):
        if i < settings.max_releases_per_pass:
            actions.append(action)
            verdicts.append(verdict)
        else:
            verdicts.append(
                dataclasses.replace(
                    verdict,
                    status="deferred",
                    why=f"{verdict.why}; waits: at most {settings.max_releases_per_pass} "
                    "releases per pass",
                )
            )
    pool_actions, notes = pool.actions(
        settings.pools,
        warm=warm or {},
        warm_pods=warm_pods,
        pending=pending,
        profiles=profiles,
        largest_node_gpus=largest_node_gpus,
    )
    actions.extend(pool_actions)
    return Decision(tuple(actions), tuple(verdicts), tuple(notes))


def _one(
    f: BoxFacts, memory: Memory, now: float, s: Settings
) -> tuple[Verdict, list[Action], tuple[float, Release] | None]:
    box = f.box
    sigs = signals(f, memory, s)
    stalled_since = hung_since = 0.0  # set once the agent is known to be heartbeating

    def verdict(status: str, why: str, idle_since: float = 0.0) -> Verdict:
        return Verdict(
            key=f.key,
            box=box.name,
            owner=box.owner,
            status=status,
            why=why,
            signals=sigs,
            idle_since=idle_since,
            gpus=box.spec.gpus,
            stalled_since=stalled_since,
            hung_since=hung_since,
        )

    ids = (f.key, box.name, box.owner)
    if box.state is not BoxState.RUNNING:
        return verdict("not-running", f"the box is {box.state.value}"), [], None
    actions: list[Action] = []
    kept = box.keep_until > now
    keep_note = f"kept (`devbox keep`) for another {_span(box.keep_until - now)}"

    # Health first: a silent agent's activity is stale, so it says nothing about use.
    # A claimed warm pod's agent may have beaten long before the claim: count from there.
    silent_since = max(f.heartbeat_at, box.created_at)
    silent = now - silent_since
    if silent >= s.unhealthy_after:
        why = f"agent silent for {_span(silent)} (no heartbeat)"
        if not box.unhealthy_since:
            actions.append(MarkUnhealthy(*ids, since=silent_since, why=why))
        if kept:
            return verdict("kept", f"{why}; {keep_note}"), actions, None
        if silent >= s.unhealthy_release_after:
            release = Release(*ids, reason="unhealthy", why=why)
            return verdict("releasing", why), actions, (silent_since, release)
        left = s.unhealthy_release_after - silent
        return verdict("unhealthy", f"{why}; released in {_span(left)}"), actions, None
    if box.unhealthy_since:
        actions.append(MarkHealthy(*ids, why="agent heartbeats again"))
    stalled_since, hung_since = hang_times(f.activity)

    if kept:
        if box.release_at:
            actions.append(Unwarn(*ids, why=keep_note))
        return verdict("kept", keep_note), actions, None
    age = now - box.created_at
    if age < s.grace:
        if box.release_at:
            actions.append(Unwarn(*ids, why="new box"))
        return verdict("new", f"claimed {_span(age)} ago (grace {_span(s.grace)})"), actions, None

    active = [sig for sig in sigs if sig.active_now]
    last = max([box.created_at, *(sig.last_active for sig in sigs)])
    idle_since = f.heartbeat_at if active and f.heartbeat_at else last
    quiet = now - idle_since
    lifetime_end = box.created_at + s.max_lifetime if s.max_lifetime else 0.0

    want: tuple[str, float] | None = None
    if lifetime_end and now >= lifetime_end - s.warning:
        want = ("lifetime", lifetime_end)
    elif now >= idle_since + s.idle_timeout - s.warning:
        want = ("idle", idle_since + s.idle_timeout)

    # A hung box: only a person's use (or a probe step) since the hang began counts. The
    # idle rule above stands as it is; whichever release comes first wins.
    hung_from, hung_text, used = hung_since, "", ""
    if hung_since:
        person = [sig for sig in sigs if sig.name in _PERSON_SIGNALS]
        latest = max(person, key=lambda sig: sig.last_active, default=None)
        hung_text = f"hung for {_span(now - hung_since)}: {_HANG}"
        if latest is not None and latest.last_active > hung_since:
            hung_from, used = latest.last_active, f"{latest.name} recently"
            hung_text += f"; {latest.name} {_span(now - hung_from)} ago"
    hung_end = hung_from + s.hung_grace
    if (
        hung_since
        and s.hung == "release"
        and now >= hung_end - s.warning
        and (want is None or hung_end < want[1])
    ):
        want = ("hung", hung_end)

    if want is None:
        busy = ", ".join(sig.detail for sig in active) or _latest(sigs)
        if hung_since and s.hung == "release":
            if box.release_at:
                actions.append(Unwarn(*ids, why=f"in use again: {used or busy}"))
            until, grace = _span(hung_end - now), _span(s.hung_grace)
            why = f"{hung_text}; released in {until} (hung_grace {grace})"
            return verdict("hung", why, idle_since), actions, None
        if box.release_at:
            actions.append(Unwarn(*ids, why=f"in use again: {busy}"))
        if quiet >= IDLE_AFTER:
            left = idle_since + s.idle_timeout - now
            why = f"every signal quiet for {_span(quiet)}; warned in {_span(left - s.warning)}"
            status = "idle"
        else:
            why, status = f"in use: {busy}", "busy"
        if hung_since:  # hung = "report": the usual rules, the hang shown
            why = f'{hung_text}; only reported (hung = "report"), so as usual: {why}'
            status = "hung"
        return verdict(status, why, idle_since), actions, None

    reason, deadline = want
    if reason == "lifetime":
        why = f"claimed {_span(age)} ago (max_lifetime {_span(s.max_lifetime)})"
    elif reason == "hung":
        why = f"{hung_text}; hung_grace {_span(s.hung_grace)}"
    else:
        why = f"every signal quiet for {_span(quiet)} (idle_timeout {_span(s.idle_timeout)})"
    if not box.release_at or box.release_reason != reason:
        # The user always gets the full warning, even when the autoscaler was away.
        release_at = max(deadline, now + s.warning)
        actions.append(Warn(*ids, release_at=release_at, reason=reason, why=why))
        left = release_at - now
        return verdict("warned", f"{why}; released in {_span(left)}", idle_since), actions, None
    if now < box.release_at:
        left = box.release_at - now
        return verdict("warned", f"{why}; released in {_span(left)}", idle_since), actions, None
    release = Release(*ids, reason=reason, why=why, save_within=s.save_timeout)
    return verdict("releasing", why, idle_since), actions, (box.release_at, release)


def _latest(sigs: Sequence[Signal]) -> str:
    used = [sig for sig in sigs if sig.last_active]
    if not used:
        return "recently claimed"
    best = max(used, key=lambda sig: sig.last_active)
    return f"{best.name} recently"
