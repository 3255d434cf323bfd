"""What the box's users are doing, as the agent sees it: the record the autoscaler, `devbox
ls` and the TUI read (a file for a local box, the Lease's annotations in a pod).

Signals of a person at work, whatever their client: keys typed in a terminal and commands
started (`last_input`); traffic from the client through port forwards (an editor's server
connection, its terminals, forwarded ports), SFTP/scp and commands' stdin, each counted
once it passes a floor per window (protocol.TRAFFIC_FLOOR), so keepalives do not count;
probe batches; `devbox run` experiments; and the load of the box's GPUs and processes."""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from devbox import private, protocol

log = logging.getLogger("devbox.agent")

# The activity file is rewritten at most this often; input can arrive per keystroke.
ACTIVITY_WRITE_INTERVAL = 1.0
# A failing activity write (a full or read-only state disk) is logged at most this often.
ACTIVITY_FAILURE_LOG_INTERVAL = 300.0


@dataclass
class Activity:
    """What the box's users do: the autoscaler and `devbox ls` read it from the activity file."""

    path: Path | None
    last_input: float = field(default_factory=time.time)
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
    _written: float = 0.0
    # Failed writes since the last logged one, and when that was (monotonic; 0: none yet).
    _failures: int = 0
    _failure_logged: float = 0.0

    def input(self) -> None:
        self.last_input = time.time()
        self._maybe_write()

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
            self._maybe_write()

    def probe(self) -> None:
        self.last_probe = time.time()
        self._maybe_write()

    def set_runs(self, count: int) -> None:
        if count != self.runs:
            self.runs = count
            self._maybe_write(force=True)

    def observe(self, sample: protocol.Sample) -> None:
        """Note a telemetry sample's load figures (the sampler already took them)."""
        utils = [g["util"] for g in sample["gpus"] if g["util"] is not None]
        me = os.getpid()
        cpus = [p["cpu"] for p in sample["processes"] if p["pid"] != me and p["cpu"] is not None]
        t = sample["t"]
        self._load.append(
            (
                t,
                sum(utils) / len(utils) if utils else None,
                sum(cpus) if cpus else (0.0 if sample["processes"] else None),
            )
        )
        while self._load[0][0] < t - protocol.ACTIVITY_WINDOW:
            self._load.popleft()
        # Rewritten at most once a second: its age is also the local box's heartbeat.
        self._maybe_write()

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
        }

    def client(self, delta: int) -> None:
        self.clients += delta
        self._maybe_write(force=True)

    def _maybe_write(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self._written < ACTIVITY_WRITE_INTERVAL):
            return
        self._written = now
        try:
            private.write_text(self.path, json.dumps(self.snapshot()))
        except OSError as exc:
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
