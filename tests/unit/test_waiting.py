"""Waiting messages name what a box pod actually waits for. The scheduler and controller
messages here are verbatim from kube-scheduler and the PV controller of the test cluster
(v1.36.3); tests/k8s checks the same words come out of a real `devbox up`."""

from __future__ import annotations

from typing import Any

from devbox.backends.kubernetes import waiting

CPU = (
    "0/6 nodes are available: 1 node(s) had untolerated taint(s), 5 Insufficient cpu. no new "
    "claims to deallocate, preemption: 0/6 nodes are available: 6 Preemption is not helpful "
    "for scheduling."
)
GPU = (
    "0/6 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated "
    "taint(s), 4 node(s) didn't match Pod's node affinity/selector. no new claims to "
    "deallocate, preemption: 0/6 nodes are available: 6 Preemption is not helpful for "
    "scheduling."
)
MIXED = (
    "0/6 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated "
    "taint(s), 5 Insufficient memory. no new claims to deallocate, preemption: 0/6 nodes are "
    "available: 6 Preemption is not helpful for scheduling."
)
UNBOUND = "0/6 nodes are available: pod has unbound immediate PersistentVolumeClaims. not found"


def _pending(message: str) -> dict[str, Any]:
    return {
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "message": message}],
        }
    }


def test_cpu_is_not_gpus() -> None:
    said = waiting.describe(_pending(CPU))
    assert said.startswith("waiting for free CPU (")
    assert "GPU" not in said and "5 nodes short of CPU" in said and "1 node tainted" in said


def test_gpus_with_the_other_reasons_named() -> None:
    said = waiting.describe(_pending(GPU))
    assert said.startswith("waiting for free GPUs (")
    assert "1 node short of GPUs" in said and "4 nodes outside the profile's node selector" in said


def test_two_resources_short_at_once() -> None:
    said = waiting.describe(_pending(MIXED))
    assert said.startswith("waiting for free GPUs and memory (")
    assert "5 nodes short of memory" in said


def test_an_unbound_claim_with_a_missing_storage_class_says_what_to_set() -> None:
    claim = {
        "metadata": {"name": "devbox-homes"},
        "spec": {"storageClassName": "nope"},
        "status": {"phase": "Pending"},
    }
    events = [
        {"reason": "ProvisioningFailed", "message": 'storageclass.storage.k8s.io "nope" not found'}
    ]
    said = waiting.describe(
        _pending(UNBOUND),
        claim=claim,
        claim_events=events,
        config_hint="~/.config/devbox/config.toml",
    )
    assert "storage class 'nope' does not exist" in said
    assert "set home_storage_class in ~/.config/devbox/config.toml" in said
    assert "GPU" not in said


def test_an_unbound_claim_that_is_only_slow() -> None:
    claim = {"metadata": {"name": "devbox-homes"}, "spec": {}, "status": {"phase": "Pending"}}
    said = waiting.describe(_pending(UNBOUND), claim=claim)
    assert said == "waiting for the homes volume: claim devbox-homes is Pending"


def test_an_image_that_cannot_be_pulled() -> None:
    pod = {
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "image": "registry.example/box:1",
                    "state": {
                        "waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling"}
                    },
                }
            ],
        },
    }
    problem, failed = waiting.container_problem(pod)
    assert failed and problem.startswith("cannot pull the image registry.example/box:1:")
    assert waiting.describe(pod) == problem


def test_a_scheduled_pod_pulling_its_image() -> None:
    pod = {"spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}}
    events = [{"reason": "Pulling", "message": 'Pulling image "registry.example/box:1"'}]
    assert waiting.describe(pod, pod_events=events) == (
        'pulling the image: Pulling image "registry.example/box:1"'
    )
    assert waiting.describe(pod) == "starting the box's container"


def test_nothing_to_say_before_the_scheduler_looked() -> None:
    assert waiting.describe({"status": {"phase": "Pending"}}) == ""
