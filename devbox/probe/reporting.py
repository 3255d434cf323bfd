"""What every framework's probe shares, so each (PyTorch today; Keras 3 and Flax NNX are
issue 21's next step) sends one wire format and `devbox probe` has one view of them all:
the columns of a report, the link to the agent, who watches, which step is observed, the
queued requests, and the frames themselves.

A framework's watcher subclasses StepReporter and does only the tensor work: at a step's
start it asks `plan()` what this step must do; it computes the statistics on its own
device (inside a compiled step where it can), and hands the results over as a `Host`, a
callable the link thread runs to read them, so the training thread never waits for the
device. No framework here: numbers and numpy-free callables only.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from devbox import protocol
from devbox.probe import alerts as alert_policy
from devbox.probe import release
from devbox.probe.link import Job, Link
from devbox.protocol import LayerStats, ProbeAlert, ProbeRequest

# Columns of a report: activation statistics first (ACT of them), then parameter ones.
ACT_COLUMNS = ("act_mean", "act_std", "act_absmax", "act_zeros", "act_dead", "act_nan", "act_inf")
PARAM_COLUMNS = ("grad_norm", "grad_nan", "weight_norm", "update_ratio")
ACT = len(ACT_COLUMNS)
COLUMNS = ACT_COLUMNS + PARAM_COLUMNS
_COUNTS = {"act_nan", "act_inf", "grad_nan"}

Host = Callable[[], Any]  # a device value, readable on the link thread

# Unwatched, a heartbeat goes every `every` steps, and also at the first step's end this
# long after the last frame: the agent tells a slow step from a hung process by it
# (devbox.hang), and `every` steps of a large model can take minutes.
STEP_BEAT = 5.0
# An activation request waits this many steps for its layer to run, then is answered
# with an error (a layer in a branch not taken).
REQUEST_TRIES = 3


def rows(names: Sequence[str], matrix: Sequence[Sequence[float]]) -> list[LayerStats]:
    """The report matrix (one row per layer, COLUMNS) as wire records: NaN/Inf become
    None, counts become ints."""
    out: list[LayerStats] = []
    for name, row in zip(names, matrix, strict=True):
        record: dict[str, object] = {"name": name}
        for column, value in zip(COLUMNS, row, strict=True):
            value = float(value)
            if column in _COUNTS:
                record[column] = int(value) if math.isfinite(value) else 0
            else:
                record[column] = value if math.isfinite(value) else None
        out.append(record)  # type: ignore[arg-type]
    return out


def check_request(r: ProbeRequest, layers: Sequence[str]) -> str | None:
    """Why a well-formed request (protocol.probe_request) cannot be answered; None when it
    can."""
    if r["kind"] not in protocol.PROBE_REQUEST_KINDS:
        return f"unknown request {r['kind']!r}"
    if r["tensor"] not in protocol.PROBE_TENSORS:
        return f"unknown tensor {r['tensor']!r}: one of {', '.join(protocol.PROBE_TENSORS)}"
    if r["layer"] not in layers:
        return f"no layer {r['layer']!r} is watched (layers: {', '.join(layers[:30])})"
    bins = r.get("bins", 30)
    if not 1 <= bins <= protocol.MAX_HISTOGRAM_BINS:
        return f"bins must be 1 to {protocol.MAX_HISTOGRAM_BINS}"
    return None


def error_reply(request_id: Any, step: int, message: str) -> Job:
    reply = {"id": request_id, "pid": os.getpid(), "step": step, "error": message}
    return lambda: [protocol.encode(protocol.PROBE_REPLY, **reply)]


def check_every(every: object, where: str) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{where}: every must be a whole number >= 1, not {every!r}")
    return every


@dataclass(frozen=True)
class Plan:
    """What one step does, decided at its start."""

    observe: bool  # compute and send the per-layer statistics
    check: bool  # only check that the output (or loss) is finite
    requests: tuple[ProbeRequest, ...]  # requests this step answers (observe is then True)

    def wants(self, tensor: str) -> set[str]:
        """The layers whose `tensor` a request of this step needs whole."""
        return {r["layer"] for r in self.requests if r["tensor"] == tensor}


class StepReporter:
    """The framework-free half of a watcher. `framework` names what it hooks ("torch",
    "keras/jax", "jax"); it travels in the hello, so the view says what it is looking at."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        every: int,
        thresholds: alert_policy.Thresholds,
        framework: str,
        find_socket: Callable[[], str | None] | None = None,
    ) -> None:
        self.names = list(names)
        self.every = every
        self.thresholds = thresholds
        self.framework = framework
        self.step = 0
        self.watching = False  # somebody subscribed (the agent says)
        self.force = False  # observe the next step: a check found NaN
        self._requests: collections.deque[ProbeRequest] = collections.deque()
        self.active: list[ProbeRequest] = []  # requests taken by a step, not answered yet
        self._tries: dict[int, int] = {}
        # time.monotonic() at the last step's end, and what that step took: a release
        # waits for the next step when one is due soon (devbox.probe.release).
        self.last_step = 0.0
        self.step_seconds = 0.0
        self._last_frame = 0.0  # time.monotonic() of the last report or heartbeat
        hello = {
            "pid": os.getpid(),
            "cmd": " ".join(sys.argv)[:200],
            "layers": self.names,
            "every": every,
            "framework": framework,
        }
        self.link = Link(
            hello=hello,
            on_frame=self._on_frame,
            **({"find": find_socket} if find_socket is not None else {}),
        )

    def start(self) -> None:
        self.link.start()
        release.steppers.add(self)

    def close(self) -> None:
        release.steppers.discard(self)
        self.link.close()

    # --- the step ---------------------------------------------------------------------

    def plan(self) -> Plan:
        """At a step's start: does it observe, check, or do nothing?"""
        connected = self.link.connected
        due = self.step % self.every == 0
        while self._requests:
            self.active.append(self._requests.popleft())
        observe = connected and ((self.watching and due) or self.force or bool(self.active))
        self.force = False
        check = connected and not observe and (self.watching or due)
        return Plan(observe, check, tuple(self.active) if observe else ())

    def step_ended(self, *, observed: bool) -> int:
        """At a step's end (after the optimizer's update): the clock, a heartbeat when the
        step was not observed, a save that waits for a step boundary. Returns the step's
        number; `self.step` is the next one's."""
        now = time.monotonic()  # the one clock read of a step
        if self.last_step:
            self.step_seconds = now - self.last_step
        self.last_step = now
        step = self.step
        self.step += 1
        if observed:
            self._last_frame = now
        else:
            due = step % self.every == 0
            if ((due and not self.watching) or now - self._last_frame > STEP_BEAT) and (
                self.link.connected
            ):
                self._last_frame = now
                self.link.submit(lambda: [self._stats_frame(step, [])])
        if release.pending is not None:  # one attribute read while no save waits
            release.at_step()  # after the optimizer's update: the weights are whole
        return step

    # --- what the link thread runs ----------------------------------------------------

    def submit_report(self, step: int, matrix: Host) -> None:
        """`matrix()` gives one row of COLUMNS per watched layer, in `names` order."""
        names, limits, pid = list(self.names), self.thresholds, os.getpid()

        def job() -> list[bytes]:
            layers = rows(names, matrix())
            raised = alert_policy.evaluate(layers, step=step, limits=limits)
            body = {"pid": pid, "step": step, "t": time.time(), "watched": True}
            return [protocol.encode(protocol.PROBE_STATS, **body, layers=layers, alerts=raised)]

        self.link.submit(job)

    def submit_check(self, step: int, total: Host) -> None:
        """`total()` is one number (the output's sum, or the loss): NaN or Inf raises the
        alert now, and the next step is observed, to say which layer."""

        def job() -> list[bytes]:
            value = float(_scalar(total()))
            if math.isfinite(value):
                return []
            self.force = True
            return [self._stats_frame(step, [alert_policy.nonfinite_output(step=step)])]

        self.link.submit(job)

    def submit(self, job: Job) -> None:
        self.link.submit(job)

    def reply_error(self, r: ProbeRequest, message: str) -> None:
        self.link.submit(error_reply(r["id"], self.step, message))

    def answered(self, r: ProbeRequest) -> None:
        if r in self.active:
            self.active.remove(r)
        self._tries.pop(r["id"], None)

    def expire(self) -> None:
        """After an observed step: an activation request whose layer did not run for
        REQUEST_TRIES steps is answered with an error, not kept for ever."""
        for r in [r for r in self.active if r["tensor"] == "activation"]:
            self._tries[r["id"]] = tries = self._tries.get(r["id"], 0) + 1
            if tries > REQUEST_TRIES:
                self.answered(r)
                self.reply_error(r, f"layer {r['layer']} did not run in the last 3 steps")

    def _stats_frame(self, step: int, raised: list[ProbeAlert]) -> bytes:
        body = {"pid": os.getpid(), "step": step, "t": time.time(), "watched": False}
        return protocol.encode(protocol.PROBE_STATS, **body, layers=[], alerts=raised)

    def _on_frame(self, frame: protocol.Frame) -> None:
        """On the link thread: the agent's control and request frames (a "stacks" request
        never comes here: the link answers it itself)."""
        if frame.type == protocol.PROBE_CONTROL:
            self.watching = bool(frame.body.get("watching"))
        elif frame.type == protocol.PROBE_REQUEST:
            try:
                request = protocol.probe_request(frame)
            except protocol.ProtocolError as exc:
                # Answered all the same: the asker waits for its id, not for a timeout.
                self.link.submit(error_reply(frame.body.get("id", 0), self.step, exc.message))
                return
            error = check_request(request, self.names)
            if error is None:
                self._requests.append(request)
                return
            self.link.submit(error_reply(request["id"], self.step, error))


def _scalar(value: Any) -> Any:
    # A one-element list or array, or a plain number.
    while isinstance(value, list | tuple):
        value = value[0]
    return value
