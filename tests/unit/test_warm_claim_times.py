"""Issue 16 (14f): a box claimed from the warm pool is its user's from the claim, so AGE
and IDLE both count from there: never IDLE longer than AGE because the pool's pod (and
its agent's activity clock) started earlier."""

from __future__ import annotations

import time
from typing import Any

from devbox import protocol as p
from devbox.backends.kubernetes import pods
from devbox.boxes import Box, BoxSpec, BoxState

T0 = 1_700_000_000.0  # the pool made the pod, and its agent started
T1 = T0 + 3 * 3600  # a user claimed it three hours later
NOW = T1 + 60


def _claimed_warm_pod() -> dict[str, Any]:
    made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0))
    return {
        "metadata": {
            "name": "devbox-warm-abc123",
            "namespace": "lab",
            "creationTimestamp": made,
            "labels": {
                p.LABEL_MANAGED: "devbox",
                p.LABEL_STATE: "claimed",
                p.LABEL_BOX: "mine",
                p.LABEL_OWNER: "ada",
            },
            "annotations": {p.ANN_CLAIMED_AT: f"{T1:.3f}", p.ANN_OWNER_NAME: "ada"},
        },
        "spec": {"containers": [{"image": "box:1"}]},
        "status": {"phase": "Running"},
    }


def test_a_claimed_warm_pod_is_idle_no_longer_than_its_age() -> None:
    # The agent's last input is its own start: nobody has typed since the pool made it.
    box = pods.to_box(_claimed_warm_pod(), activity={"last_input": T0, "clients": 0})
    age, idle = NOW - box.created_at, box.idle_seconds(NOW)
    assert box.created_at == T1 and age == 60
    assert idle is not None and idle <= age and idle == 60
    assert box.last_activity == T1


def test_input_after_the_claim_still_counts() -> None:
    box = pods.to_box(_claimed_warm_pod(), activity={"last_input": T1 + 50, "clients": 0})
    assert box.last_activity == T1 + 50 and box.idle_seconds(NOW) == 10


def test_unknown_activity_stays_unknown() -> None:
    assert pods.to_box(_claimed_warm_pod(), activity=None).idle_seconds(NOW) is None


def test_no_box_is_idle_for_longer_than_it_has_existed() -> None:
    box = Box(
        name="b",
        owner="ada",
        backend="local",
        spec=BoxSpec(),
        state=BoxState.RUNNING,
        created_at=T1,
        last_activity=T0,
    )
    assert box.idle_seconds(NOW) == NOW - T1
