"""The autoscaler's loop: look (no per-box requests), decide (the pure policy), act,
remember. Thin on purpose; the backends' `World`s do the talking."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from devbox.autoscaler import policy
from devbox.autoscaler.config import MAX_INTERVAL, MIN_INTERVAL, Settings
from devbox.autoscaler.metrics import Metrics
from devbox.autoscaler.state import Released
from devbox.autoscaler.world import World

log = logging.getLogger("devbox.autoscaler")


@dataclass
class PassResult:
    decision: policy.Decision
    applied: list[policy.Action]
    failed: list[tuple[policy.Action, str]]
    seconds: float


class Autoscaler:
    def __init__(
        self,
        world: World,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.world, self.settings, self.clock = world, settings, clock
        self.metrics = metrics or Metrics()
        self.state = world.load_state()
        self._saved = self.state.dumps()
        self._last_pass = 0.0
        self._noted: set[str] = set()

    def reconcile(self) -> PassResult:
        started = time.perf_counter()
        snap = self.world.snapshot()
        now = self.clock()
        self.state.memory = policy.observe(self.state.memory, snap.facts, self.settings)
        decision = policy.decide(
            snap.facts,
            memory=self.state.memory,
            now=now,
            settings=self.settings,
            warm=snap.warm,
            warm_pods=snap.warm_pods,
            pending=snap.pending,
            profiles=snap.profiles,
            largest_node_gpus=snap.largest_node_gpus,
        )
        for note in set(decision.notes) - self._noted:  # once each, not every pass
            log.warning("%s", note)
        self._noted = set(decision.notes)
        applied, failed = [], []
        for action in decision.actions:
            try:
                done = self.world.apply(action)
            except Exception as exc:  # one failed action must not stop the others
                log.warning("%s failed: %s", _describe(action), exc)
                failed.append((action, str(exc)))
                continue
            if not done:
                log.info("%s: skipped, the box changed meanwhile", _describe(action))
                continue
            applied.append(action)
            log.info("%s", _describe(action))
            if isinstance(action, policy.Release):
                self.state.record(
                    Released(action.box, action.owner, now, action.reason, action.why, action.key)
                )
        text = self.state.dumps()
        if text != self._saved:
            self.world.save_state(text)
            self._saved = text
        elapsed = now - self._last_pass if self._last_pass else 0.0
        self._last_pass = now
        seconds = time.perf_counter() - started
        self.metrics.update(
            decision, applied, snap, since_last=elapsed, pass_seconds=seconds, failed=len(failed)
        )
        return PassResult(decision, applied, failed, seconds)

    def run(self, stop: threading.Event) -> None:
        """Reconcile every `interval` until stop; a failed pass is logged and retried."""
        # parse() checks the interval; Settings made in code are not. A zero, tiny or NaN
        # wait returns at once (a busy loop) and an infinite one raises OverflowError (the
        # loop dies): clamp, with `not >=` so that NaN clamps too.
        wait = self.settings.interval
        if not wait >= MIN_INTERVAL:
            wait = MIN_INTERVAL
        wait = min(wait, MAX_INTERVAL)
        while not stop.is_set():
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile pass failed; retrying")
                self.metrics.pass_failed()
            stop.wait(wait)


def _describe(action: policy.Action) -> str:
    if isinstance(action, policy.CreateWarm):
        return f"warm pool {action.profile}/{action.gpus} GPU(s): creating {action.count} pod(s)"
    if isinstance(action, policy.Yield):
        return f"yielded warm pod {action.key} ({action.profile}): {action.why}"
    if isinstance(action, policy.DropStale):
        return f"deleted stale warm pod {action.key}: {action.why}"
    kind = type(action).__name__
    words = {
        "Warn": "warned",
        "Unwarn": "withdrew the warning for",
        "Release": "released",
        "MarkUnhealthy": "marked unhealthy",
        "MarkHealthy": "marked healthy",
    }
    return f"{words[kind]} box {action.box} of {action.owner or '?'}: {action.why}"
