"""The warm pools' part of the policy: pure, from what the loop found to actions.

Warm pods run at the same priority as claimed boxes (a pod's priority is fixed when it is
made, and a claim keeps the pod: a warm pod made at a lower priority would leave the user
who claimed it preemptible for as long as the box lives). So the scheduler never preempts
a warm pod for real work; the autoscaler yields them instead. The rule, per pass:

- Pending work is every pod the scheduler could not place for lack of `nvidia.com/gpu`
  (its own warm pods left out: a warm pod waiting for GPUs is no reason to drop another),
  but not one asking for more GPUs than the largest node has (when the nodes are known):
  no yield could ever place it, and anyone who may create a pod could otherwise empty
  every GPU pool for as long as it waits.
- The GPUs already coming back count first: those of warm pods being deleted, and of
  pods of a stale shape dropped in this pass.
- Then unclaimed warm pods holding GPUs on a node are yielded, the largest first (fewest
  pods lost for the GPUs needed), the newest first among equals (the oldest are the most
  likely to be ready for a claim), until the GPUs they free cover what the pending pods
  ask for. Where those GPUs lie is not weighed: a pod that still cannot be placed is
  pending on the next pass, which yields more.
- Unclaimed warm pods that wait for GPUs themselves are yielded too: at the same
  priority they would race the pending work for the GPUs just freed.
- GPU pools are not refilled while GPU work is pending. Claimed boxes are never touched:
  they are not in the warm pods this module is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from devbox.autoscaler.config import PoolTarget


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmPod:
    """An unclaimed warm pod as the loop found it."""

    key: str  # the pod's name
    profile: str
    gpus: int
    current: bool  # its shape is its profile's shape now (else it is stale)
    scheduled: bool  # bound to a node, so its GPUs are held there
    deleting: bool = False
    created_at: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingPod:
    """Any pod but a warm one that the scheduler could not place for lack of GPUs."""

    key: str  # namespace/name
    gpus: int
    why: str  # the scheduler's message


@dataclasses.dataclass(frozen=True)
class CreateWarm:
    profile: str
    gpus: int
    count: int


@dataclasses.dataclass(frozen=True)
class Yield:
    """Delete an unclaimed warm pod so that pending work gets its GPUs."""

    key: str
    profile: str
    gpus: int
    why: str


@dataclasses.dataclass(frozen=True)
class DropStale:
    """Delete an unclaimed warm pod whose shape is no longer its profile's."""

    key: str
    profile: str
    why: str


PoolAction = CreateWarm | Yield | DropStale


def actions(
    targets: Sequence[PoolTarget],
    *,
    warm: Mapping[tuple[str, int], int],
    warm_pods: Sequence[WarmPod] = (),
    pending: Sequence[PendingPod] = (),
    profiles: Mapping[str, int] | None = None,
    largest_node_gpus: int | None = None,
) -> tuple[list[PoolAction], list[str]]:
    """The pools' actions and notes (what could not be done, for the log). `warm` counts
    the unclaimed pods of the current shape per (profile, GPUs); `profiles` is each known
    profile's GPU count (None: the world has no profiles, a pool's GPUs are as written);
    `largest_node_gpus` the most GPUs one node has (None: unknown, every pod may fit)."""
    out: list[PoolAction] = []
    notes: list[str] = []
    if largest_node_gpus is not None:
        never = [w for w in pending if w.gpus > largest_node_gpus]
        if never:
            notes.append(
                f"{len(never)} pending pod(s) ask for more GPUs than any node has "
                f"({never[0].key}: {never[0].gpus} > {largest_node_gpus}); no warm pod "
                "yields to them"
            )
            pending = [w for w in pending if w.gpus <= largest_node_gpus]
    live = [w for w in warm_pods if not w.deleting]
    for w in live:
        if not w.current:
            out.append(DropStale(w.key, w.profile, f"its shape is no longer profile {w.profile}'s"))
    out.extend(_yields(warm_pods, pending))
    kept: set[tuple[str, int]] = set()
    for target in targets:
        gpus = target.gpus
        if profiles is not None:
            if target.profile not in profiles:
                notes.append(f"pool {target.profile}: no such profile; no warm pods made")
                continue
            gpus = profiles[target.profile] if gpus is None else gpus
        gpus = gpus or 0
        if (target.profile, gpus) in kept:
            notes.append(f"pool {target.profile} with {gpus} GPU(s) is listed twice; one counts")
            continue
        kept.add((target.profile, gpus))
        if gpus and pending:
            continue  # its GPUs go to the pending work first
        have = warm.get((target.profile, gpus), 0)
        if have < target.size:
            out.append(CreateWarm(target.profile, gpus, target.size - have))
    return out, notes


def _yields(warm_pods: Sequence[WarmPod], pending: Sequence[PendingPod]) -> list[Yield]:
    need = sum(p.gpus for p in pending)
    if not need:
        return []
    first = pending[0]
    waiting = f"{len(pending)} pending pod(s) want {need} GPU(s) ({first.key}: {first.why})"
    freed = sum(w.gpus for w in warm_pods if w.scheduled and (w.deleting or not w.current))
    candidates = [w for w in warm_pods if w.current and not w.deleting and w.gpus > 0]
    out = [
        Yield(w.key, w.profile, w.gpus, f"it would race them for GPUs: {waiting}")
        for w in candidates
        if not w.scheduled
    ]
    held = sorted(
        (w for w in candidates if w.scheduled), key=lambda w: (-w.gpus, -w.created_at, w.key)
    )
    for w in held:
        if freed >= need:
            break
        out.append(Yield(w.key, w.profile, w.gpus, f"frees {w.gpus} GPU(s): {waiting}"))
        freed += w.gpus
    return out
