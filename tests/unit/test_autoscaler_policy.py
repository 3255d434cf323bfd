"""The autoscaler's pure policy against a fake clock: every rule, and the loop's memory."""

from __future__ import annotations

import dataclasses
import time

from devbox.autoscaler import policy
from devbox.autoscaler.config import SIGNALS, PoolTarget, Settings
from devbox.autoscaler.loop import Autoscaler
from devbox.autoscaler.state import State, loads
from devbox.autoscaler.world import Snapshot
from devbox.boxes import Box, BoxSpec, BoxState, release_warning
from devbox.protocol import Activity
from devbox.views.explain import render

T0 = 1_000_000.0
S = Settings(
    idle_timeout=600,
    warning=60,
    grace=120,
    unhealthy_after=30,
    unhealthy_release_after=300,
    max_releases_per_pass=2,
)


def box(name: str = "b", **kw: object) -> Box:
    base: dict[str, object] = {
        "name": name,
        "owner": "ann",
        "backend": "local",
        "spec": BoxSpec(gpus=1),
        "state": BoxState.RUNNING,
        "created_at": T0,
    }
    base.update(kw)
    return Box(**base)  # type: ignore[arg-type]


def act(last_input: float = T0, **kw: object) -> Activity:
    a: dict[str, object] = {
        "last_input": last_input,
        "clients": 0,
        "last_probe": 0.0,
        "runs": 0,
        "gpu_util": 0.0,
        "cpu": 0.0,
    }
    a.update(kw)
    return a  # type: ignore[return-value]


def facts(b: Box, a: Activity | None, beat: float) -> policy.BoxFacts:
    return policy.BoxFacts(key=b.name, box=b, activity=a, heartbeat_at=beat)


def decide(
    fs: list[policy.BoxFacts], now: float, memory: policy.Memory | None = None, s: Settings = S
) -> policy.Decision:
    mem = policy.observe(memory or {}, fs, s)
    return policy.decide(fs, memory=mem, now=now, settings=s)


def kinds(d: policy.Decision) -> list[str]:
    return [type(a).__name__ for a in d.actions]


def test_idle_box_is_warned_then_released_after_the_timeout() -> None:
    b = box()
    # Quiet, but not yet long enough for the warning (idle_timeout - warning = 540 s).
    d = decide([facts(b, act(), T0 + 530)], T0 + 530)
    assert kinds(d) == [] and d.verdicts[0].status == "idle"
    d = decide([facts(b, act(), T0 + 545)], T0 + 545)
    (warn,) = d.actions
    assert isinstance(warn, policy.Warn) and warn.reason == "idle"
    assert warn.release_at == T0 + 605  # the full warning: now + 60 beats idle + 600
    warned = dataclasses.replace(b, release_at=warn.release_at, release_reason="idle")
    d = decide([facts(warned, act(), T0 + 600)], T0 + 600)
    assert kinds(d) == [] and d.verdicts[0].status == "warned"
    d = decide([facts(warned, act(), T0 + 606)], T0 + 606)
    (release,) = d.actions
    assert isinstance(release, policy.Release) and release.reason == "idle"
    assert release.save_within == S.save_timeout  # its probed processes save first


def test_on_time_warning_releases_exactly_at_the_idle_timeout() -> None:
    (warn,) = decide([facts(box(), act(), T0 + 540)], T0 + 540).actions
    assert isinstance(warn, policy.Warn) and warn.release_at == T0 + 600


def test_late_warning_still_gives_the_full_lead_time() -> None:
    # The autoscaler was away: the box has been idle for hours. It is warned, not released.
    (warn,) = decide([facts(box(), act(), T0 + 9000)], T0 + 9000).actions
    assert isinstance(warn, policy.Warn) and warn.release_at == T0 + 9060


def test_use_after_the_warning_withdraws_it() -> None:
    warned = box(release_at=T0 + 600, release_reason="idle")
    d = decide([facts(warned, act(last_input=T0 + 580), T0 + 590)], T0 + 590)
    (unwarn,) = d.actions
    assert isinstance(unwarn, policy.Unwarn) and d.verdicts[0].status == "busy"


def test_training_without_typing_is_never_released() -> None:
    b = box()
    memory: policy.Memory = {}
    for step in range(0, 20_000, 10):
        now = T0 + step
        fs = [facts(b, act(gpu_util=95.0), now)]
        memory = policy.observe(memory, fs, S)
        d = policy.decide(fs, memory=memory, now=now, settings=S)
        assert d.actions == () and d.verdicts[0].status in ("new", "busy"), step


def test_each_signal_alone_keeps_a_box() -> None:
    now = T0 + 5000
    cases = {
        "clients": act(clients=1),
        "runs": act(runs=1),
        "gpu": act(gpu_util=50.0),
        "cpu": act(cpu=150.0),
        "probe": act(last_probe=now - 5),
        "input": act(last_input=now - 5),
        "forwards": act(last_forward=now - 5),
        "sftp": act(last_sftp=now - 5),
        "stdin": act(last_exec=now - 5),
    }
    assert set(cases) == set(SIGNALS)
    every = dataclasses.replace(S, signals=SIGNALS)
    for name, a in cases.items():
        d = decide([facts(box(), a, now)], now, s=every)
        assert d.actions == () and d.verdicts[0].status == "busy", name
        (sig,) = [s for s in d.verdicts[0].signals if s.name == name]
        assert sig.active_now or sig.last_active >= now - 5
    # Below the thresholds is quiet.
    quiet = act(gpu_util=4.0, cpu=10.0)
    assert kinds(decide([facts(box(), quiet, now)], now)) == ["Warn"]


def test_editor_traffic_counts_by_default_and_explain_names_each_signal() -> None:
    # VS Code works through port forwards: by default its traffic keeps the box.
    now = T0 + 5000
    d = decide([facts(box(), act(last_forward=now - 30), now)], now)
    (verdict,) = d.verdicts
    assert d.actions == () and verdict.status == "busy", verdict
    assert verdict.why == "in use: forwards recently"
    b = box()
    text = render(verdict, facts(b, act(last_forward=now - 30), now), State(), now=now)
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.startswith("  ")}
    assert "last active 30s ago" in lines["forwards"]
    assert "port-forward traffic (at least 4 KiB in 60 s)" in lines["forwards"]
    assert "SFTP/scp transfers" in lines["sftp"] and "input to commands" in lines["stdin"]
    assert "never active" in lines["sftp"]
    # Once the forwards go quiet for the idle timeout, the box is warned as any other.
    later = now + S.idle_timeout
    assert kinds(decide([facts(box(), act(last_forward=now - 30), later)], later)) == ["Warn"]


def test_an_idle_open_session_is_not_use_by_default() -> None:
    now = T0 + 5000
    assert kinds(decide([facts(box(), act(clients=2), now)], now)) == ["Warn"]


def test_a_disabled_signal_does_not_count() -> None:
    only_input = dataclasses.replace(S, signals=("input",))
    now = T0 + 5000
    d = decide([facts(box(), act(gpu_util=99.0), now)], now, s=only_input)
    assert kinds(d) == ["Warn"]


def test_memory_remembers_the_last_busy_moment_of_state_signals() -> None:
    b = box()
    mem = policy.observe({}, [facts(b, act(gpu_util=90.0), T0 + 1000)], S)
    # Later reports say the GPU is quiet: idle counts from the last busy report.
    later = [facts(b, act(), T0 + 1500)]
    mem = policy.observe(mem, later, S)
    d = policy.decide(later, memory=mem, now=T0 + 1500, settings=S)
    assert d.verdicts[0].idle_since == T0 + 1000 and d.verdicts[0].status == "idle"
    later = [facts(b, act(), T0 + 1545)]
    d = policy.decide(later, memory=policy.observe(mem, later, S), now=T0 + 1545, settings=S)
    assert kinds(d) == ["Warn"]
    # Gone boxes are forgotten.
    assert policy.observe(mem, [], S) == {}


def test_new_boxes_have_a_grace_period() -> None:
    b = box(created_at=T0)
    s = dataclasses.replace(S, idle_timeout=100, warning=10)
    d = decide([facts(b, act(last_input=T0 - 10_000), T0 + 100)], T0 + 100, s=s)
    assert d.actions == () and d.verdicts[0].status == "new"
    assert kinds(decide([facts(b, act(last_input=T0 - 10_000), T0 + 121)], T0 + 121, s=s)) == [
        "Warn"
    ]


def test_keep_holds_until_its_time_then_the_box_is_warned() -> None:
    kept = box(keep_until=T0 + 3000, release_at=T0 + 1000, release_reason="idle")
    d = decide([facts(kept, act(), T0 + 2000)], T0 + 2000)
    assert kinds(d) == ["Unwarn"] and d.verdicts[0].status == "kept"
    held = dataclasses.replace(kept, release_at=0.0, release_reason="")
    assert decide([facts(held, act(), T0 + 2999)], T0 + 2999).actions == ()
    assert kinds(decide([facts(held, act(), T0 + 3001)], T0 + 3001)) == ["Warn"]


def test_maximum_lifetime_warns_then_releases_even_a_busy_box() -> None:
    s = dataclasses.replace(S, max_lifetime=1000)
    busy = act(gpu_util=80.0)
    (warn,) = decide([facts(box(), busy, T0 + 945)], T0 + 945, s=s).actions
    assert isinstance(warn, policy.Warn) and warn.reason == "lifetime"
    assert warn.release_at == T0 + 1005
    warned = box(release_at=warn.release_at, release_reason="lifetime")
    assert decide([facts(warned, busy, T0 + 1000)], T0 + 1000, s=s).actions == ()
    (release,) = decide([facts(warned, busy, T0 + 1006)], T0 + 1006, s=s).actions
    assert isinstance(release, policy.Release) and release.reason == "lifetime"


def test_silent_agent_is_marked_then_released_after_a_longer_grace() -> None:
    b = box()
    now = T0 + 1000
    d = decide([facts(b, act(runs=1), now - 20)], now)
    assert d.actions == ()
    d = decide([facts(b, act(runs=1), now - 40)], now)
    (mark,) = d.actions
    assert isinstance(mark, policy.MarkUnhealthy) and mark.since == now - 40
    assert d.verdicts[0].status == "unhealthy"
    marked = dataclasses.replace(b, unhealthy_since=now - 40)
    assert decide([facts(marked, act(runs=1), now - 299)], now).actions == ()
    (release,) = decide([facts(marked, act(runs=1), now - 301)], now).actions
    assert isinstance(release, policy.Release) and release.reason == "unhealthy"
    assert release.save_within == 0  # a silent agent could not ask anyone to save
    # Heartbeats again: the mark goes.
    back = decide([facts(marked, act(runs=1), now - 1)], now)
    assert kinds(back) == ["MarkHealthy"] and back.verdicts[0].status == "busy"
    # An agent that never reported counts from the claim.
    never = decide([facts(b, None, 0.0)], T0 + 31)
    assert kinds(never) == ["MarkUnhealthy"]


def test_releases_per_pass_are_capped_oldest_first() -> None:
    now = T0 + 5000
    fs = [
        facts(box(f"b{i}", release_at=now - i, release_reason="idle"), act(), now) for i in range(5)
    ]
    d = decide(fs, now)
    released = [a.box for a in d.actions if isinstance(a, policy.Release)]
    assert released == ["b4", "b3"]
    assert sorted(v.box for v in d.verdicts if v.status == "deferred") == ["b0", "b1", "b2"]


def test_not_running_boxes_are_left_alone() -> None:
    for state in (BoxState.PENDING, BoxState.RELEASING, BoxState.FAILED):
        d = decide([facts(box(state=state), None, 0.0)], T0 + 99_999)
        assert d.actions == () and d.verdicts[0].status == "not-running"


def test_warm_pool_is_topped_up() -> None:
    s = dataclasses.replace(
        S, pools=(PoolTarget(profile="a", gpus=1, size=3), PoolTarget(profile="b", gpus=0, size=1))
    )
    d = policy.decide([], memory={}, now=T0, settings=s, warm={("a", 1): 1, ("b", 0): 4})
    assert d.actions == (policy.CreateWarm("a", 1, 2),)


class FakeWorld:
    def __init__(self, facts: list[policy.BoxFacts], saved: str = "") -> None:
        self.facts = facts
        self.saved = saved
        self.applied: list[policy.Action] = []

    def snapshot(self) -> Snapshot:
        return Snapshot(self.facts)

    def apply(self, action: policy.Action) -> bool:
        self.applied.append(action)
        return True

    def load_state(self) -> State:
        return loads(self.saved)

    def save_state(self, text: str) -> None:
        self.saved = text


def test_the_loop_persists_its_memory_so_a_restart_forgets_nothing() -> None:
    b = box()
    clock = [T0 + 1000.0]
    world = FakeWorld([facts(b, act(gpu_util=90.0), T0 + 1000)])
    Autoscaler(world, S, clock=lambda: clock[0]).reconcile()
    # A new autoscaler process: the GPU went quiet meanwhile.
    world.facts = [facts(b, act(), T0 + 1500)]
    clock[0] = T0 + 1500
    again = Autoscaler(world, S, clock=lambda: clock[0])
    result = again.reconcile()
    assert result.decision.verdicts[0].idle_since == T0 + 1000
    assert world.applied == []
    # A release is recorded for `devbox explain`.
    world.facts = [facts(box(release_at=T0 + 1600, release_reason="idle"), act(), T0 + 1700)]
    clock[0] = T0 + 1700
    again.reconcile()
    assert [type(a).__name__ for a in world.applied] == ["Release"]
    released = loads(world.saved).last_release("b")
    assert released is not None and released.reason == "idle" and released.at == T0 + 1700


def test_metrics_exposition() -> None:
    b = box(release_at=T0 + 100, release_reason="idle")
    world = FakeWorld([facts(b, act(), T0 + 1000)])
    scaler = Autoscaler(world, S, clock=lambda: T0 + 1000)
    scaler.reconcile()
    text = scaler.metrics.render()
    assert 'devbox_releases_total{reason="idle"} 1' in text
    assert 'devbox_boxes{status="releasing"} 1' in text
    assert "devbox_claim_latency_seconds_count 0" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split()) == 2, line


# --- a hung box (devbox.hang): busy GPUs at low power, no probe step, no input ---------

HUNG_AT = T0 + 1000.0  # the agent's verdict: hung since then
H = dataclasses.replace(S, hung_grace=1800)  # warned at HUNG_AT + 1740, released at + 1800


def hung_act(hung_since: float = HUNG_AT, **kw: object) -> Activity:
    base: dict[str, object] = {
        "gpu_util": 100.0,
        "cpu": 100.0,
        "runs": 1,
        "stalled_since": HUNG_AT - 600,
        "hung_since": hung_since,
    }
    base.update(kw)
    a: dict[str, object] = dict(act())
    a.update(base)
    return a  # type: ignore[return-value]


def run_passes(b: Box, a: Activity, start: float, end: float, s: Settings = H) -> policy.Decision:
    """Passes every 10 s with the same report, from `start` to `end`, as the loop makes them."""
    memory: policy.Memory = {}
    d = policy.Decision((), ())
    for now in range(int(start), int(end) + 1, 10):
        fs = [facts(b, a, float(now))]
        memory = policy.observe(memory, fs, s)
        d = policy.decide(fs, memory=memory, now=float(now), settings=s)
        if d.actions:
            return d
    return d


def test_a_hung_box_is_warned_with_the_full_warning_then_released() -> None:
    b = box()
    # 100% GPU, CPU and a run going: none of it keeps the box; nothing happens until the
    # warning is due (hung_grace - warning after the hang began).
    d = run_passes(b, hung_act(), HUNG_AT, HUNG_AT + 1730)
    assert d.actions == ()
    (v,) = d.verdicts
    assert v.status == "hung" and v.hung_since == HUNG_AT and v.stalled_since == HUNG_AT - 600
    assert v.why == (
        "hung for 28m: GPUs busy at low power, no probe step, no input (devbox.hang); "
        "released in 1m (hung_grace 30m)"
    )
    (gpu,) = [sig for sig in v.signals if sig.name == "gpu"]
    assert gpu.detail == "GPU 100% (threshold 5%); not use: the box is hung"
    d = decide([facts(b, hung_act(), HUNG_AT + 1740)], HUNG_AT + 1740, s=H)
    (warn,) = d.actions
    assert isinstance(warn, policy.Warn) and warn.reason == "hung"
    assert warn.release_at == HUNG_AT + 1800 and d.verdicts[0].status == "warned"
    assert warn.why.startswith("hung for 29m: GPUs busy at low power")
    warned = box(release_at=warn.release_at, release_reason="hung")
    assert decide([facts(warned, hung_act(), HUNG_AT + 1799)], HUNG_AT + 1799, s=H).actions == ()
    d = decide([facts(warned, hung_act(), HUNG_AT + 1800)], HUNG_AT + 1800, s=H)
    (release,) = d.actions
    assert isinstance(release, policy.Release) and release.reason == "hung"
    assert d.verdicts[0].status == "releasing"


def test_a_late_hung_warning_still_gives_the_full_warning() -> None:
    # The autoscaler was away for the whole hung_grace: warned now, released a warning later.
    now = HUNG_AT + 9000
    (warn,) = decide([facts(box(), hung_act(), now)], now, s=H).actions
    assert isinstance(warn, policy.Warn) and warn.reason == "hung"
    assert warn.release_at == now + H.warning


def test_input_on_a_hung_box_withdraws_the_hung_warning() -> None:
    warned = box(release_at=HUNG_AT + 1800, release_reason="hung")
    now = HUNG_AT + 1760
    # The agent ends the hang on input: hung_since goes back to 0, the GPU is busy again.
    d = decide([facts(warned, act(last_input=now - 5, gpu_util=100.0), now)], now, s=H)
    (unwarn,) = d.actions
    assert isinstance(unwarn, policy.Unwarn) and d.verdicts[0].status == "busy"
    # Use the agent has not folded into its verdict yet counts too: the hung_grace
    # starts again from it.
    d = decide([facts(warned, hung_act(last_forward=now - 5), now)], now, s=H)
    (unwarn,) = d.actions
    assert isinstance(unwarn, policy.Unwarn) and unwarn.why == "in use again: forwards recently"
    assert d.verdicts[0].status == "hung" and "forwards 5s ago" in d.verdicts[0].why
    # ... and a probe step.
    d = decide([facts(warned, hung_act(last_probe=now - 5), now)], now, s=H)
    assert kinds(d) == ["Unwarn"] and d.verdicts[0].status == "hung"


def test_a_kept_hung_box_is_not_warned() -> None:
    kept = box(keep_until=HUNG_AT + 5000)
    now = HUNG_AT + 3000
    d = decide([facts(kept, hung_act(), now)], now, s=H)
    assert d.actions == () and d.verdicts[0].status == "kept"
    assert d.verdicts[0].hung_since == HUNG_AT  # still shown
    warned = dataclasses.replace(kept, release_at=now + 10, release_reason="hung")
    assert kinds(decide([facts(warned, hung_act(), now)], now, s=H)) == ["Unwarn"]
    # Once the keep ends, the full warning.
    later = HUNG_AT + 5001
    (warn,) = decide([facts(kept, hung_act(), later)], later, s=H).actions
    assert isinstance(warn, policy.Warn) and warn.release_at == later + H.warning


def test_hung_report_shows_the_hang_and_changes_nothing_else() -> None:
    report = dataclasses.replace(H, hung="report")
    b = box()
    d = run_passes(b, hung_act(), HUNG_AT, HUNG_AT + 20_000, s=report)
    assert d.actions == ()
    (v,) = d.verdicts
    assert v.status == "hung" and 'only reported (hung = "report")' in v.why
    assert v.why.endswith(
        "so as usual: in use: GPU 100% (threshold 5%), CPU 100% of a core "
        "(threshold 20%), 1 run(s) going"
    )
    (gpu,) = [sig for sig in v.signals if sig.name == "gpu"]
    assert gpu.detail == "GPU 100% (threshold 5%)"
    # The idle rules still apply with the usual signals: a hung box whose GPU signal is
    # off is warned for idleness, as it is today.
    only_input = dataclasses.replace(report, signals=("input",))
    now = HUNG_AT + 5000
    (warn,) = decide([facts(b, hung_act(), now)], now, s=only_input).actions
    assert isinstance(warn, policy.Warn) and warn.reason == "idle"


def test_the_first_release_wins_between_idle_and_hung() -> None:
    # Idle by the usual rule (only input counts here) long before hung_grace passes.
    only_input = dataclasses.replace(H, signals=("input",), idle_timeout=600, hung_grace=36000)
    now = HUNG_AT + 600
    (warn,) = decide([facts(box(), hung_act(), now)], now, s=only_input).actions
    assert isinstance(warn, policy.Warn) and warn.reason == "idle"
    # A short hung_grace and a long idle_timeout: the hang's release comes first.
    short = dataclasses.replace(H, signals=("input",), idle_timeout=36000, hung_grace=120)
    now = HUNG_AT + 60
    (warn,) = decide([facts(box(), hung_act(), now)], now, s=short).actions
    assert isinstance(warn, policy.Warn) and warn.reason == "hung"
    assert warn.release_at == HUNG_AT + 120


def test_a_busy_box_that_is_not_hung_stays_busy() -> None:
    b = box()
    d = run_passes(b, hung_act(hung_since=0.0, stalled_since=0.0), T0, T0 + 20_000)
    assert d.actions == () and d.verdicts[0].status == "busy"
    assert d.verdicts[0].hung_since == 0.0
    (gpu,) = [sig for sig in d.verdicts[0].signals if sig.name == "gpu"]
    assert gpu.detail == "GPU 100% (threshold 5%)"
    # Stalled, not hung yet: still busy.
    d = run_passes(b, hung_act(hung_since=0.0), T0, T0 + 20_000)
    assert d.actions == () and d.verdicts[0].status == "busy"
    assert d.verdicts[0].stalled_since == HUNG_AT - 600


def test_a_hang_time_no_clock_wrote_is_not_a_hang() -> None:
    now = HUNG_AT + 5000
    for bad in (float("nan"), float("inf"), -5.0):
        d = decide([facts(box(), hung_act(hung_since=bad, stalled_since=bad), now)], now, s=H)
        assert d.actions == () and d.verdicts[0].status == "busy", bad
        assert d.verdicts[0].hung_since == 0.0


def test_hung_releases_share_the_cap_per_pass() -> None:
    now = HUNG_AT + 5000
    fs = [
        facts(box(f"h{i}", release_at=now - i, release_reason="hung"), hung_act(), now)
        for i in range(4)
    ]
    d = decide(fs, now, s=H)
    released = [a.box for a in d.actions if isinstance(a, policy.Release)]
    assert released == ["h3", "h2"]
    assert sorted(v.box for v in d.verdicts if v.status == "deferred") == ["h0", "h1"]


def test_metrics_count_hung_boxes_and_their_gpu_hours_apart_from_idle_ones() -> None:
    hung = box("h", spec=BoxSpec(gpus=4))
    warned = box("w", spec=BoxSpec(gpus=2), release_at=HUNG_AT + 9000, release_reason="hung")
    idle = box("i", spec=BoxSpec(gpus=1))
    clock = [HUNG_AT + 100.0]

    def world_at(now: float) -> list[policy.BoxFacts]:
        return [
            facts(hung, hung_act(), now),
            facts(warned, hung_act(), now),
            facts(idle, act(), now),
        ]

    world = FakeWorld(world_at(clock[0]))
    scaler = Autoscaler(world, H, clock=lambda: clock[0])
    scaler.reconcile()
    clock[0] += 1800  # half an hour later
    world.facts = world_at(clock[0])
    result = scaler.reconcile()
    statuses = {v.box: v.status for v in result.decision.verdicts}
    assert statuses == {"h": "warned", "w": "warned", "i": "warned"}
    text = scaler.metrics.render()
    assert "devbox_hung_gpus 6" in text
    assert "devbox_hung_gpu_hours_total 3" in text  # 6 GPUs for half an hour
    assert "devbox_idle_gpu_hours_total 0.5" in text  # the idle box's one GPU only
    assert 'devbox_boxes{status="hung"} 0' in text
    # Before the warning, a hung box is counted by its own status.
    clock[0] = HUNG_AT + 100.0
    world.facts = [facts(hung, hung_act(), clock[0])]
    fresh = Autoscaler(world, H, clock=lambda: clock[0])
    fresh.reconcile()
    assert 'devbox_boxes{status="hung"} 1' in fresh.metrics.render()
    assert "devbox_hung_gpus 4" in fresh.metrics.render()


def test_a_hung_warning_reads_well_where_users_see_it() -> None:
    at = time.mktime((2026, 12, 3, 14, 30, 0, 0, 0, -1))
    text = release_warning("b", "hung", at)
    assert text == (
        "devbox: box b looks hung (its GPUs busy at low power, no training step, no input); "
        "it will be released at 14:30:00 unless used (`devbox keep b` holds it)"
    )
    assert release_warning("b", "idle", at).startswith("devbox: box b has been idle; it will")
    note = box(release_at=at, release_reason="hung").autoscaler_note(at - 600)
    assert note == "looks hung: released in 10m unless used (or `devbox keep b`)"


def test_explain_says_since_when_a_box_is_hung_and_stalled() -> None:
    now = HUNG_AT + 1500
    b = box()
    a = hung_act()
    (v,) = decide([facts(b, a, now)], now, s=H).verdicts
    text = render(v, facts(b, a, now), State(), now=now)
    first, *rest = text.splitlines()
    assert first.startswith("box b (ann): hung: hung for 25m: GPUs busy at low power")
    assert "released in 5m (hung_grace 30m)" in first
    clock = time.strftime("%a %H:%M", time.localtime(HUNG_AT))
    stalled_clock = time.strftime("%a %H:%M", time.localtime(HUNG_AT - 600))
    assert (
        f"  hung for 25m (since {clock}), stalled for 35m (since {stalled_clock}): "
        "GPUs busy at low power, no probe step, no input"
    ) in rest
    gpu = next(line for line in rest if line.split()[0] == "gpu")
    assert "active now" in gpu and gpu.endswith("GPU 100% (threshold 5%); not use: the box is hung")
    # Stalled, not hung: said so; neither: no line.
    a = hung_act(hung_since=0.0)
    (v,) = decide([facts(b, a, now)], now, s=H).verdicts
    text = render(v, facts(b, a, now), State(), now=now)
    assert f"  stalled for 35m (since {stalled_clock}): GPUs busy at low power; not hung" in text
    a = act(gpu_util=100.0)
    (v,) = decide([facts(b, a, now)], now, s=H).verdicts
    assert "stalled" not in render(v, facts(b, a, now), State(), now=now)
