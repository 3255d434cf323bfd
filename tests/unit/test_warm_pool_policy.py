"""The warm pools' rules (devbox.autoscaler.pool), pure: stale shapes are dropped, warm
pods yield to pods waiting for GPUs (never a claimed box: those are not warm pods), and
GPU pools wait while such pods do."""

from __future__ import annotations

from devbox.autoscaler import policy
from devbox.autoscaler.config import PoolTarget, Settings, parse
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.state import State, loads
from devbox.autoscaler.world import Snapshot

T0 = 1_000_000.0


def warm(key: str, gpus: int = 1, *, age: float = 0.0, **kw: object) -> policy.WarmPod:
    base: dict[str, object] = {
        "key": key,
        "profile": "gpu",
        "gpus": gpus,
        "current": True,
        "scheduled": True,
        "created_at": T0 - age,
    }
    base.update(kw)
    return policy.WarmPod(**base)  # type: ignore[arg-type]


def pending(gpus: int, key: str = "other/train") -> policy.PendingPod:
    return policy.PendingPod(key=key, gpus=gpus, why="0/5 nodes: Insufficient nvidia.com/gpu")


def decide(
    *,
    pools: tuple[PoolTarget, ...] = (),
    counts: dict[tuple[str, int], int] | None = None,
    warm_pods: tuple[policy.WarmPod, ...] = (),
    waiting: tuple[policy.PendingPod, ...] = (),
    profiles: dict[str, int] | None = None,
    largest: int | None = None,
) -> policy.Decision:
    return policy.decide(
        [],
        memory={},
        now=T0,
        settings=Settings(pools=pools),
        warm=counts or {},
        warm_pods=warm_pods,
        pending=waiting,
        profiles=profiles,
        largest_node_gpus=largest,
    )


def kinds(d: policy.Decision) -> list[tuple[str, str]]:
    return [(type(a).__name__, getattr(a, "key", "")) for a in d.actions]


def test_nothing_pending_nothing_yielded() -> None:
    d = decide(warm_pods=(warm("w1"), warm("w2", 2)))
    assert d.actions == ()


def test_enough_warm_pods_yield_to_cover_the_pending_gpus_largest_then_newest() -> None:
    pods = (warm("old1", 1, age=300), warm("new1", 1, age=10), warm("two", 2, age=100))
    # One GPU wanted: the 2-GPU pod covers it alone (the fewest pods lost).
    assert kinds(decide(warm_pods=pods, waiting=(pending(1),))) == [("Yield", "two")]
    # Three: the 2-GPU pod, then the newest 1-GPU one (the oldest is likeliest ready).
    d = decide(warm_pods=pods, waiting=(pending(1), pending(2, "ns/b")))
    assert kinds(d) == [("Yield", "two"), ("Yield", "new1")]
    (first, _) = d.actions
    assert isinstance(first, policy.Yield) and first.gpus == 2
    assert "2 pending pod(s) want 3 GPU(s) (other/train: 0/5 nodes: Insufficient" in first.why
    # More than all of them hold: all go, and no more can.
    assert len(decide(warm_pods=pods, waiting=(pending(9),)).actions) == 3


def test_gpus_already_coming_back_count_first() -> None:
    going = warm("going", 1, deleting=True)
    stale = warm("stale", 1, current=False)
    d = decide(warm_pods=(going, stale, warm("w1"), warm("w2")), waiting=(pending(3),))
    # The stale pod is dropped (its GPU counts), the deleting one is already going: one
    # more yields (of equals, by name).
    assert kinds(d) == [("DropStale", "stale"), ("Yield", "w1")]


def test_unscheduled_and_cpu_only_warm_pods() -> None:
    waiting_warm = warm("queued", 1, scheduled=False)
    cpu_only = warm("cpu", 0)
    d = decide(warm_pods=(waiting_warm, cpu_only, warm("w1")), waiting=(pending(1),))
    # A warm pod waiting for GPUs would race the pending pod for the freed one: it goes
    # too (and frees nothing); a CPU-only one holds no GPU and stays.
    assert sorted(kinds(d)) == [("Yield", "queued"), ("Yield", "w1")]


def test_a_pod_no_node_could_hold_is_no_reason_to_yield() -> None:
    """Anyone who may create pods could otherwise empty every GPU pool with one pod that
    asks for more GPUs than a node has, for as long as it waits."""
    pools = (PoolTarget(profile="gpu", gpus=None, size=1),)
    pods = (warm("w1"), warm("w2", 2))
    d = decide(
        pools=pools,
        counts={("gpu", 1): 1},
        profiles={"gpu": 1},
        warm_pods=pods,
        waiting=(pending(9),),
        largest=8,
    )
    assert d.actions == ()  # nothing yielded, and the pool is full: nothing to make
    assert d.notes == (
        "1 pending pod(s) ask for more GPUs than any node has (other/train: 9 > 8); "
        "no warm pod yields to them",
    )
    # A pod that fits still gets them, whatever waits beside it.
    d = decide(warm_pods=pods, waiting=(pending(9), pending(2, "ns/fits")), largest=8)
    assert kinds(d) == [("Yield", "w2")]
    # With the nodes unknown, every pending pod counts, as before.
    assert len(decide(warm_pods=pods, waiting=(pending(9),)).actions) == 2


def test_gpu_pools_are_not_refilled_while_gpu_work_waits() -> None:
    pools = (
        PoolTarget(profile="gpu", gpus=None, size=2),
        PoolTarget(profile="default", gpus=None, size=1),
    )
    profiles = {"gpu": 1, "default": 0}
    d = decide(pools=pools, profiles=profiles, waiting=(pending(1),))
    assert d.actions == (policy.CreateWarm("default", 0, 1),)
    d = decide(pools=pools, profiles=profiles)
    assert set(d.actions) == {policy.CreateWarm("gpu", 1, 2), policy.CreateWarm("default", 0, 1)}


def test_pools_take_the_profiles_gpus_and_counts_are_of_the_current_shape() -> None:
    pools = (
        PoolTarget(profile="gpu", gpus=None, size=2),
        PoolTarget(profile="gpu", gpus=4, size=1),
        PoolTarget(profile="gone", gpus=None, size=1),
    )
    d = decide(pools=pools, profiles={"gpu": 1, "default": 0}, counts={("gpu", 1): 1})
    assert d.actions == (policy.CreateWarm("gpu", 1, 1), policy.CreateWarm("gpu", 4, 1))
    assert d.notes == ("pool gone: no such profile; no warm pods made",)
    # A stale pod is dropped, never counted.
    d = decide(warm_pods=(warm("old", current=False), warm("going", current=False, deleting=True)))
    assert d.actions == (policy.DropStale("old", "gpu", "its shape is no longer profile gpu's"),)


def test_pool_settings_take_the_profiles_gpu_count_by_default() -> None:
    s = parse('[[pool]]\nprofile = "gpu"\nsize = 2\n', source="x")
    assert s.pools == (PoolTarget(profile="gpu", gpus=None, size=2),)
    # Written twice once the profile's count is known: the first one counts.
    twice = (*s.pools, PoolTarget(profile="gpu", gpus=1, size=5))
    d = decide(pools=twice, profiles={"gpu": 1})
    assert d.actions == (policy.CreateWarm("gpu", 1, 2),)
    assert d.notes == ("pool gpu with 1 GPU(s) is listed twice; one counts",)


class World:
    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.applied: list[policy.Action] = []

    def snapshot(self) -> Snapshot:
        return self.snap

    def apply(self, action: policy.Action) -> bool:
        self.applied.append(action)
        return True

    def load_state(self) -> State:
        return loads("")

    def save_state(self, text: str) -> None:
        pass


def test_the_loop_applies_yields_and_counts_them() -> None:
    snap = Snapshot(
        [], {}, (), warm_pods=(warm("w1"), warm("s", current=False)), pending=(pending(2),)
    )
    world = World(snap)
    scaler = Autoscaler(world, Settings(), clock=lambda: T0)
    scaler.reconcile()
    assert [type(a).__name__ for a in world.applied] == ["DropStale", "Yield"]
    text = scaler.metrics.render()
    assert 'devbox_warm_pods_removed_total{reason="yield"} 1' in text
    assert 'devbox_warm_pods_removed_total{reason="stale"} 1' in text
    assert "devbox_gpu_pending_pods 1" in text
