"""What the autoscaler remembers across restarts, as one small JSON document (a ConfigMap
in the cluster, a file locally): when each state signal was last seen active, and the
recent releases, so `devbox explain` can say why a box that is gone was released.

Its warnings are not here: they live on the boxes themselves (pod annotations, local
records), where `devbox ls` and the TUI read them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from devbox.autoscaler.policy import Memory

STATE_CONFIG_MAP = "devbox-autoscaler-state"
STATE_KEY = "state.json"
RELEASES_KEPT = 200


@dataclass(frozen=True)
class Released:
    box: str
    owner: str
    at: float
    reason: str
    why: str
    key: str = ""  # the pod (or local box) it was


@dataclass
class State:
    memory: Memory = field(default_factory=dict)
    released: list[Released] = field(default_factory=list)

    def record(self, item: Released) -> None:
        self.released.append(item)
        del self.released[:-RELEASES_KEPT]

    def last_release(self, box: str, owner: str | None = None) -> Released | None:
        for item in reversed(self.released):
            if item.box == box and (owner is None or item.owner == owner):
                return item
        return None

    def dumps(self) -> str:
        # Whole seconds: the document changes only when a signal really moved.
        memory = {k: {s: round(t) for s, t in v.items()} for k, v in sorted(self.memory.items())}
        return json.dumps(
            {"memory": memory, "released": [asdict(r) for r in self.released]},
            separators=(",", ":"),
            sort_keys=True,
        )


def loads(text: str) -> State:
    """A State from its JSON; a document that cannot be read starts afresh (it only ever
    holds what makes decisions better informed, never what makes them safe)."""
    try:
        data: Any = json.loads(text) if text else {}
        memory = {
            str(k): {str(s): float(t) for s, t in dict(v).items()}
            for k, v in data["memory"].items()
        }
        released = [Released(**item) for item in data["released"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return State()
    return State(memory=memory, released=released)
