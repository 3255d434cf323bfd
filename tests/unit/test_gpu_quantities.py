"""GPU counts as the API server writes them: it canonicalises quantities, so a pod that
asked for 1000 GPUs reads back as "1k". Nothing that counts GPUs may crash on, or miss,
such a pod (a foreign pod in the cluster, an administrator's node)."""

from __future__ import annotations

from typing import Any

import pytest

from devbox.backends.kubernetes import pods, warmpool


@pytest.mark.parametrize(
    ("text", "count"),
    [("8", 8), ("1k", 1000), ("2M", 2_000_000), ("1Ki", 1024), ("3e2", 300), (4, 4), ("", 0)],
)
def test_whole_quantities(text: str | int, count: int) -> None:
    assert pods.count_of(text) == count


@pytest.mark.parametrize("text", ["1.5", "500m", "many", "-2", None])
def test_anything_else_is_no_gpus(text: str | None) -> None:
    assert pods.count_of(text) == 0


def _greedy(limit: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "greedy", "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {pods.GPU: limit}}}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/6 nodes are available: 6 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    }


def test_a_pod_asking_for_1k_gpus_is_seen_waiting_for_1000() -> None:
    assert pods.gpus_requested(_greedy("1k")) == 1000
    waiting = warmpool.waiting_for_gpus(_greedy("1k"))
    assert waiting is not None and waiting.gpus == 1000
