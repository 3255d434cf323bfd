"""Where a claim goes when the user has several clusters: pure policy, no I/O.

What each cluster showed (read in parallel by devbox.backends.clusters) comes in; the
order to try them in comes out, each with the reason a researcher reads in `devbox up`'s
progress. The rules, after dstack's and SkyPilot's:
- a ready warm pod anywhere beats any new pod (a claim in a second, not a minute): the
  most preferred cluster that has one;
- else clusters where a node has room for the whole claim, most preferred first, then those
  whose room is unknown (nodes not readable), then the full ones (a pod may still queue);
- a cluster that recently failed to schedule a pod goes after all of those, for the
  failure memory: a cluster that just refused is unlikely to accept a moment later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Seen:
    """One cluster as a claim found it."""

    cluster: str
    preference: int
    # Why the cluster cannot take the claim at all (unreachable, refused, no such
    # profile there); empty: it can.
    unusable: str = ""
    warm: int = 0  # ready warm pods of the claim's shape
    # Free GPUs per schedulable node; None: unknown (not read yet, or nodes not readable).
    free: Sequence[int] | None = None


@dataclass(frozen=True)
class Choice:
    cluster: str
    reason: str


def warm_choice(seen: Iterable[Seen]) -> Choice | None:
    """The most preferred usable cluster with a ready warm pod; None: there is none."""
    warm = [s for s in seen if not s.unusable and s.warm > 0]
    if not warm:
        return None
    best = min(warm, key=lambda s: s.preference)
    return Choice(best.cluster, f"{best.warm} warm pod(s) ready")


def order(seen: Iterable[Seen], *, gpus: int, failed: Mapping[str, float]) -> list[Choice]:
    """Every usable cluster in the order a new pod should try them. `failed`: the
    clusters that failed lately, and how many seconds ago."""
    ranked = []
    for index, s in enumerate(seen):
        if s.unusable:
            continue
        if s.free is None:
            group, reason = 1, "free GPUs unknown"
        elif gpus == 0 or max(s.free, default=0) >= gpus:
            group = 0
            reason = f"{sum(s.free)} GPU(s) free, {max(s.free, default=0)} on one node"
        else:
            group = 2
            reason = f"full: at most {max(s.free, default=0)} GPU(s) free on one node"
        if s.cluster in failed:
            group += 3
            reason += f"; did not schedule a pod {failed[s.cluster]:.0f}s ago"
        ranked.append(((group, s.preference, index), Choice(s.cluster, reason)))
    return [choice for _, choice in sorted(ranked, key=lambda pair: pair[0])]
