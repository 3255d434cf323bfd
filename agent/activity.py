"""What the box's users are doing, as the agent sees it: the record the autoscaler, `devbox
ls` and the TUI read (a file for a local box, the Lease's annotations in a pod).

Signals of a person at work, whatever their client: keys typed in a terminal and commands
started (`last_input`); traffic from the client through port forwards (an editor's server
connection, its terminals, forwarded ports), SFTP/scp and commands' stdin, each counted
once it passes a floor per window (protocol.TRAFFIC_FLOOR), so keepalives do not count;
probe batches; `devbox run` experiments; and the load of the box's GPUs and processes.

It also judges, sample by sample, whether the box is hung (devbox.hang): GPUs busy at
low power with no probe step and no use, for the rule's `after`. Only the agent sees every
sample, so it is the one judge; the record carries its verdict to everyone else."""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from devbox import hang, private, protocol

log = logging.getLogger("devbox.agent")

# The activity file is rewritten at most this often; input can arrive per keystroke.
ACTIVITY_WRITE_INTERVAL = 1.0
# A failing activity write (a full or read-only state disk) is logged at most this often.
ACTIVITY_FAILURE_LOG_INTERVAL = 300.0
# The box is quiet (its sampler may slow down: agent.telemetry) once this long has passed
# without use, a probe step, a running `devbox run` or load: long enough that a person
# pausing between commands or a loop between epochs keeps its 1 Hz history.
QUIET_AFTER = 30.0
# Load is any GPU at least this busy (percent), or the box's processes (the agent left
# out) using this much CPU (percent of one core): a shell at its prompt uses none, a
# `watch` or a download some.
QUIET_GPU_UTIL = 5.0
QUIET_CPU = 1.0


@dataclass
class Activity:
    """What the box's users do: the autoscaler and `devbox ls` read it from the activity file."""

    path: Path | None
    last_input: float = field(default_factory=lambda: time.time())
    clients: int = 0
    # A training loop with nobody typing is activity: the probe hub notes each batch it gets.
    last_probe: float = 0.0
    # `devbox run` experiments still running in the box.
    runs: int = 0
    # Per kind of traffic (protocol.TRAFFIC_KINDS): when it last reached the floor.
    last_traffic: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(protocol.TRAFFIC_KINDS, 0.0)
    )
    # Per kind: (monotonic start of the current window, bytes the client sent in it).
    _windows: dict[str, tuple[float, int]] = field(default_factory=dict)
    # (time, mean GPU util, CPU of the box's processes) per telemetry sample, newest last:
    # the autoscaler reads the peak over protocol.ACTIVITY_WINDOW.
    _load: collections.deque[tuple[float, float | None, float | None]] = field(
        default_factory=lambda: collections.deque(maxlen=4096)
    )
    # devbox.hang: the rule, since when the GPUs look stalled, since when the box is hung
    # (0: not now), and who hears when the box turns hung or recovers (the session).
    rule: hang.Rule = field(default_factory=hang.Rule)
    stalled_since: float = 0.0
    hung_since: float = 0.0
    on_hung: Callable[[float], None] | None = None
    # Told of every sign of use (input, traffic, probe steps, clients, a new run): the
    # sampler's way back to its full rate from a quiet box's slow ticks.
    on_use: Callable[[], None] | None = None
    # time.time() of the newest sample that showed load (QUIET_GPU_UTIL, QUIET_CPU).
    _loaded_at: float = field(default_factory=lambda: time.time())
    _written: float = 0.0
    _text: str = ""  # what the file holds, as this record last wrote it
    # Failed writes since the last logged one, and when that was (monotonic; 0: none yet).
    _failures: int = 0
    _failure_logged: float = 0.0

    def input(self) -> None:
        self.last_input = time.time()
        self._used()
        self._maybe_write()

    def _used(self) -> None:
        if self.on_use is not None:
            self.on_use()

    def keys(self, nbytes: int) -> None:
        """Keys typed in a terminal: each is a person at work."""
        self.input()

    def traffic(self, kind: str, nbytes: int) -> None:
        """`nbytes` the client sent through a forward, SFTP/scp or into a command's stdin.
        A kind counts as used when its bytes reach the floor within one window, so that a
        keepalive or an idle editor's chatter does not hold GPUs forever."""
        now = time.monotonic()
        start, total = self._windows.get(kind, (now, 0))
        if now - start >= protocol.TRAFFIC_WINDOW:
            start, total = now, 0
        total += nbytes
        self._windows[kind] = (start, total)
        if total >= protocol.TRAFFIC_FLOOR:
            self.last_traffic[kind] = time.time()
            self._used()
            self._maybe_write()

    def probe(self) -> None:
        self.last_probe = time.time()
        self._used()
        self._maybe_write()

    def set_runs(self, count: int) -> None:
        if count != self.runs:
            if count > self.runs:
                self._used()
            self.runs = count
            self._maybe_write(force=True)

    def observe(self, sample: protocol.Sample) -> None:
        """Note a telemetry sample's load figures (the sampler already took them)."""
        utils = [g["util"] for g in sample["gpus"] if g["util"] is not None]
        me = os.getpid()
        cpus = [p["cpu"] for p in sample["processes"] if p["pid"] != me and p["cpu"] is not None]
        t = sample["t"]
        cpu = sum(cpus) if cpus else (0.0 if sample["processes"] else None)
        self._load.append((t, sum(utils) / len(utils) if utils else None, cpu))
        while self._load[0][0] < t - protocol.ACTIVITY_WINDOW:
            self._load.popleft()
        if max(utils, default=0.0) >= QUIET_GPU_UTIL or (cpu or 0.0) >= QUIET_CPU:
            self._loaded_at = t
        self._judge(sample["gpus"], t)
        # Rewritten at most once a second: its age is also the local box's heartbeat.
        self._maybe_write()

    def _judge(self, gpus: list[protocol.GpuSample], t: float) -> None:
        if hang.stalled(gpus, self.rule):
            self.stalled_since = self.stalled_since or t
        else:
            self.stalled_since = 0.0
        was = self.hung_since
        self.hung_since = hang.hung_since(
            stalled_since=self.stalled_since,
            last_step=self.last_probe,
            last_use=self.last_use(),
            now=t,
            rule=self.rule,
        )
        if bool(was) != bool(self.hung_since):
            if self.hung_since:
                log.warning("the box looks hung since %s", time.ctime(self.hung_since))
            else:
                log.info("the box is no longer hung")
            self._maybe_write(force=True)
            if self.on_hung is not None:
                self.on_hung(self.hung_since)

    def quiet(self) -> bool:
        """Nothing has happened in the box for QUIET_AFTER: no use by a person, no probe
        step, no run going, no load, and it does not look stalled (devbox.hang)."""
        if self.runs or self.stalled_since:
            return False
        busy = max(self._loaded_at, self.last_probe, self.last_use())
        return time.time() - busy >= QUIET_AFTER

    def last_use(self) -> float:
        """When a person last used the box, by any signal (protocol.last_use)."""
        return max(self.last_input, *self.last_traffic.values())

    def _peaks(self) -> tuple[float | None, float | None]:
        load = list(self._load)
        gpus = [g for _, g, _ in load if g is not None]
        cpus = [c for _, _, c in load if c is not None]
        return (max(gpus) if gpus else None), (max(cpus) if cpus else None)

    def snapshot(self) -> protocol.Activity:
        # Read from the telemetry thread: plain attribute reads, no lock needed.
        gpu_util, cpu = self._peaks()
        return {
            "clients": self.clients,
            "last_input": self.last_input,
            "last_probe": self.last_probe,
            "runs": self.runs,
            "last_forward": self.last_traffic.get("forward", 0.0),
            "last_sftp": self.last_traffic.get("sftp", 0.0),
            "last_exec": self.last_traffic.get("exec", 0.0),
            "gpu_util": gpu_util,
            "cpu": cpu,
            "stalled_since": self.stalled_since,
            "hung_since": self.hung_since,
        }

    def client(self, delta: int) -> None:
        self.clients += delta
        if delta > 0:
            self._used()
        self._maybe_write(force=True)

    def _maybe_write(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._written < ACTIVITY_WRITE_INTERVAL):
            return
        self._written = now
        text = json.dumps(self.snapshot())
        try:
            if not (text == self._text and _touched(self.path)):
                private.write_text(self.path, text)
                self._text = text
        except OSError as exc:
            self._text = ""  # whatever is there now, the next write replaces it
            # Called as a session opens and on every keystroke: a full state disk must
            # never refuse or break a session. Only the record is lost (the local box
            # then looks idle and silent to `devbox ls` and the autoscaler, whose
            # grace for a silent agent is long), so: keep serving, say so now and then.
            self._failures += 1
            if not self._failure_logged or now - self._failure_logged >= (
                ACTIVITY_FAILURE_LOG_INTERVAL
            ):
                log.warning(
                    "cannot write the activity file %s (%d time(s)): %s; sessions go on",
                    self.path,
                    self._failures,
                    exc.strerror or exc,
                )
                self._failure_logged, self._failures = now, 0
            return
        if self._failure_logged:
            log.info("the activity file %s is written again", self.path)
            self._failure_logged, self._failures = 0.0, 0


def _touched(path: Path) -> bool:
    """Renew the file's age, the local box's heartbeat, where its content is unchanged (a
    quiet box's every tick): a tenth of the cost of rewriting it (a temporary file of a
    random name, written and renamed), which was most of such a tick. False: it is gone."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True
