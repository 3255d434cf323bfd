"""The autoscaler's ports: what the loop (`World`) and the commands (`Inspectable`) need of a
backend's world, and the `Snapshot` a world gives. Each backend's adapter
(backends/*/autoscaling.py) implements them; they sit below the backends and the loop, so
`Backend.autoscaler_world()` can name them and the adapters never import the loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from devbox.autoscaler import policy
from devbox.autoscaler.state import State


@dataclass(frozen=True)
class Snapshot:
    facts: Sequence[policy.BoxFacts]
    # Unclaimed warm pods of the current shape per (profile, GPU count), counting those
    # being created.
    warm: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # Seconds from claim to a serving agent, for claims seen since the last snapshot.
    claim_latencies: Sequence[float] = ()
    # Every unclaimed warm pod, and the pods waiting for GPUs (devbox.autoscaler.pool).
    warm_pods: Sequence[policy.WarmPod] = ()
    pending: Sequence[policy.PendingPod] = ()
    # Each known profile's GPU count; None: this world has no profiles (no warm pools).
    profiles: Mapping[str, int] | None = None
    # The most GPUs one node has; None: unknown (nodes not readable, or no such notion).
    largest_node_gpus: int | None = None


class World(Protocol):
    """Where boxes live, as the autoscaler sees them."""

    def snapshot(self) -> Snapshot:
        """Every box with its activity, from what the world already pushed to us."""
        ...

    def apply(self, action: policy.Action) -> bool:
        """Carry out one action; False when it no longer applies (the box changed)."""
        ...

    def load_state(self) -> State: ...

    def save_state(self, text: str) -> None: ...


class Inspectable(World, Protocol):
    def settings_text(self) -> tuple[str, str] | None:
        """(TOML text, where it came from) of the backend's own settings; None: none."""
        ...

    def find(self, name: str) -> policy.BoxFacts | None:
        """One box with its activity (a few requests: for `devbox explain` only)."""
        ...

    def history(self, facts: policy.BoxFacts | None, name: str) -> list[str]:
        """What the autoscaler recorded about the box (events), oldest first; `name` is
        the released box's key when it is gone."""
        ...

    def close(self) -> None:
        """Stop what the world started (a watch); it is not used after."""
        ...
