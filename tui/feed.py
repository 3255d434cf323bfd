"""The dashboard's one door to the world: boxes from a backend, and each box's telemetry.

Screens and widgets never call this; the app's workers do, and they write what arrives
into a `Store` that the UI reads on its own clock. That is what keeps the UI smooth with
50 boxes streaming at 10 Hz: a box's newer sample replaces an older one nobody has drawn
yet, and only boxes that changed are redrawn.

`Feed` is the seam: `BackendFeed` is the real one (a devbox backend and the boxes'
SSH connections); tests and benchmarks pass their own.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from devbox import protocol, saves
from devbox.backends.base import Backend
from devbox.boxes import Box, BoxSpec
from devbox.protocol import LayerStats, ProbeAlert, ProbeRequest, ProbeStats, Sample, SaveResult
from devbox.runs.record import Run
from devbox.views import probe as probe_view

# Seconds of 1 Hz history kept per box for sparklines and charts (the agent keeps 600).
HISTORY_POINTS = 120
# How much of a run's log the log screen shows: its end, as `tail` would.
LOG_TAIL_BYTES = 64 * 1024


class Feed(Protocol):
    async def boxes(self) -> builtins.list[Box]:
        """Every box of this user, now."""
        ...

    def problems(self) -> builtins.list[str]:
        """What the last `boxes` could not read (a cluster that did not answer), a line
        each; the boxes it listed are unaffected."""
        ...

    def stream(self, box: Box, *, rate: float) -> AsyncIterator[protocol.Frame]:
        """The box's telemetry: HISTORY frames first, then SAMPLE frames, until it fails."""
        ...

    async def claim(self, spec: BoxSpec, *, name: str | None, backend: str | None) -> Box: ...

    async def release(self, box: Box) -> builtins.list[SaveResult]:
        """Release the box, its probed processes saving first (as `devbox down`); what
        each saved."""
        ...

    async def keep(self, box: Box, *, until: float) -> Box: ...

    def enter_argv(self, box: Box) -> builtins.list[str]:
        """The command that attaches the box's session, run while the app is suspended."""
        ...

    async def runs(self, box: Box) -> builtins.list[Run]:
        """The box's `devbox run` experiments, oldest first."""
        ...

    async def run_log(self, box: Box, run_id: str) -> str:
        """The end of a run's log (what fits a screen or two)."""
        ...

    def attach_argv(self, box: Box, run_id: str) -> builtins.list[str]:
        """The command that joins a run's window, run while the app is suspended."""
        ...

    def probe(
        self, box: Box, *, outbox: asyncio.Queue[ProbeRequest]
    ) -> AsyncIterator[protocol.Frame]:
        """The box's devbox.probe stream (HELLO, PROBE_HELLO, PROBE_STATS, PROBE_REPLY,
        PROBE_GONE); requests put in `outbox` go up the same stream."""
        ...


class BackendFeed:
    """Boxes and telemetry through devbox's own backend and SSH client: the same code the
    CLI runs. Blocking backend calls go to threads."""

    def __init__(self, backend: Backend, *, cli_flags: Sequence[str] = ()) -> None:
        self.backend = backend
        # --context/--namespace the dashboard was started with: `devbox ssh` needs them too.
        self.cli_flags = list(cli_flags)

    async def boxes(self) -> builtins.list[Box]:
        return await asyncio.to_thread(self.backend.list)

    def problems(self) -> builtins.list[str]:
        return self.backend.problems()

    async def _connect(self, box: Box) -> Any:
        from devbox import connect
        from devbox.ssh import client

        sock = await asyncio.to_thread(connect.open_socket, self.backend, box)
        return await client.connect(box, sock)

    async def stream(self, box: Box, *, rate: float) -> AsyncIterator[protocol.Frame]:
        from devbox.ssh import telemetry

        conn = await self._connect(box)
        try:
            async for frame in telemetry.frames(conn, box.name, rate=rate, history=True):
                yield frame
        finally:
            conn.close()

    async def claim(self, spec: BoxSpec, *, name: str | None, backend: str | None) -> Box:
        chosen = self.backend
        if backend is not None and backend != self.backend.name:
            from devbox import config
            from devbox.backends import get

            chosen = get(backend, config.load())

        def claim() -> Box:
            # The form names a profile and a GPU count: the profile gives the rest.
            resolved = chosen.resolve(spec.profile, gpus=spec.gpus)
            return chosen.claim(resolved, name=name)

        return await asyncio.to_thread(claim)

    async def release(self, box: Box) -> builtins.list[SaveResult]:
        from devbox import config

        save = saves.Ask(within=config.load().save_timeout, reason="down")
        await asyncio.to_thread(partial(self.backend.release, box.name, save=save))
        return save.results

    async def keep(self, box: Box, *, until: float) -> Box:
        return await asyncio.to_thread(partial(self.backend.keep, box.name, until=until))

    def _flags(self, box: Box) -> builtins.list[str]:
        """What addresses `box` in a `devbox` child: this dashboard's flags, and the box's
        cluster where the user has several (found at once, not by asking them all)."""
        flags = builtins.list(self.cli_flags) if box.backend == self.backend.name else []
        return [
            "--backend",
            box.backend,
            *flags,
            *(["--cluster", box.cluster] if box.cluster else []),
        ]

    def enter_argv(self, box: Box) -> builtins.list[str]:
        return [sys.executable, "-m", "devbox", "ssh", *self._flags(box), box.name]

    async def runs(self, box: Box) -> builtins.list[Run]:
        from devbox.runs import remote

        return await asyncio.to_thread(remote.list_runs, self.backend, box)

    async def run_log(self, box: Box, run_id: str) -> str:
        from devbox.runs import remote

        raw = await asyncio.to_thread(
            partial(remote.read_log, self.backend, box, run_id, tail=LOG_TAIL_BYTES)
        )
        return raw.decode(errors="replace")

    def attach_argv(self, box: Box, run_id: str) -> builtins.list[str]:
        return [sys.executable, "-m", "devbox", "attach", *self._flags(box), box.name, run_id]

    async def probe(
        self, box: Box, *, outbox: asyncio.Queue[ProbeRequest]
    ) -> AsyncIterator[protocol.Frame]:
        from devbox.ssh import probe as probe_stream

        conn = await self._connect(box)
        try:
            async for frame in probe_stream.frames(conn, box.name, outbox=outbox):
                yield frame
        finally:
            conn.close()


def run_attached(argv: builtins.list[str]) -> int:
    """Run an interactive command on the terminal (the app is suspended meanwhile)."""
    return subprocess.run(argv, check=False).returncode


@dataclass
class BoxView:
    """What the UI knows about one box: its record, its newest sample, recent history."""

    box: Box
    sample: Sample | None = None
    # Mean GPU utilisation per second, for the table's sparkline.
    util: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_POINTS)
    )
    # Per GPU index: (util, memory %, power W, temperature C) per second, for the charts.
    gpu_history: dict[int, collections.deque[tuple[float, float, float, float]]] = field(
        default_factory=dict
    )
    link: str = "connecting"  # "live", "connecting", or "lost: why"
    # How many points the history has taken in: what was drawn from it is current while
    # this has not moved (samples come at up to 10 Hz, history grows at 1 Hz).
    recorded: int = 0
    _last_history_t: float = 0.0

    @property
    def hung_since(self) -> float:
        """Since when the box's agent judges it hung (devbox.hang), 0: not: its newest
        sample says it first, the box list (a few seconds behind) otherwise."""
        if self.sample is not None and "activity" in self.sample:
            return self.sample["activity"].get("hung_since", self.box.hung_since)
        return self.box.hung_since

    def add(self, sample: Sample) -> None:
        self.sample = sample
        # History at 1 Hz whatever the stream's rate: charts span minutes, not seconds.
        if sample["t"] - self._last_history_t >= 0.95:
            self._last_history_t = sample["t"]
            self._record(sample)

    def add_history(self, samples: builtins.list[Sample]) -> None:
        for s in samples:
            self._last_history_t = s["t"]
            self._record(s)

    def _record(self, sample: Sample) -> None:
        self.recorded += 1
        utils = [g["util"] for g in sample["gpus"] if g["util"] is not None]
        self.util.append(sum(utils) / len(utils) if utils else 0.0)
        for g in sample["gpus"]:
            points = self.gpu_history.setdefault(
                g["index"], collections.deque(maxlen=HISTORY_POINTS)
            )
            used, total = g["mem_used"], g["mem_total"]
            mem_pct = 100.0 * used / total if used is not None and total else 0.0
            points.append((g["util"] or 0.0, mem_pct, g["power_w"] or 0.0, g["temp_c"] or 0.0))


@dataclass
class ModelView:
    """What the UI knows about the models training in one box (devbox.probe)."""

    processes: dict[int, str] = field(default_factory=dict)  # pid -> [framework] command
    stats: dict[int, ProbeStats] = field(default_factory=dict)  # newest report per pid
    # Per (pid, layer): gradient norms of recent reports, for the table's sparklines.
    grad_history: dict[tuple[int, str], collections.deque[float]] = field(default_factory=dict)
    # Histograms of the selected layer, oldest first: (step, counts, low, high).
    histograms: collections.deque[tuple[int, builtins.list[int], float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=HISTOGRAMS)
    )
    alerts: builtins.list[ProbeAlert] = field(default_factory=list)
    link: str = "connecting"
    selected: tuple[int, str] | None = None  # the layer whose histogram is followed

    def add(self, frame: protocol.Frame) -> None:
        body = frame.body
        if frame.type == protocol.HELLO:
            for p in body.get("processes") or []:
                if p.get("layers", True):  # not a release-only link (probe.on_release): no model
                    self.processes[int(p.get("pid", 0))] = probe_view.process_label(p)
            self.alerts = list(body.get("alerts") or [])
        elif frame.type == protocol.PROBE_HELLO:  # a process that connected since
            if body.get("layers"):
                self.processes[int(body.get("pid", 0))] = probe_view.process_label(body)
        elif frame.type == protocol.PROBE_STATS:
            pid = int(body.get("pid", 0))
            self.processes.setdefault(pid, "")
            raised = body.get("alerts") or []
            if raised:
                self.alerts += [{**a, "pid": pid} for a in protocol.probe_stats(frame)["alerts"]]
                del self.alerts[:-ALERTS]
            else:  # a healthy report: alerts of processes that ended are not current (as the hub)
                self.alerts = [a for a in self.alerts if a.get("pid") in self.processes]
            if body.get("watched"):
                self.stats[pid] = protocol.probe_stats(frame)
                layers: builtins.list[LayerStats] = body.get("layers") or []
                for s in layers:
                    points = self.grad_history.setdefault(
                        (pid, s["name"]), collections.deque(maxlen=HISTORY_POINTS)
                    )
                    points.append(s["grad_norm"] or 0.0)
        elif frame.type == protocol.PROBE_REPLY and "counts" in body:
            self.histograms.append(
                (int(body.get("step", 0)), body["counts"], body["low"], body["high"])
            )
        elif frame.type == protocol.PROBE_GONE:
            pid = int(body.get("pid", 0))
            self.processes.pop(pid, None)
            self.stats.pop(pid, None)


HISTOGRAMS = 12  # the selected layer's histogram over time: this many rows
ALERTS = 50


class Store:
    """The newest of everything, written by workers, read by the UI on its clock."""

    def __init__(self) -> None:
        self.views: dict[str, BoxView] = {}
        self.models: dict[str, ModelView] = {}
        self.dirty: set[str] = set()
        self.boxes_changed = True  # the first redraw builds the table
        self.problem: str | None = None  # why the box list could not be read
        # `devbox run` experiments of the boxes whose screen was opened.
        self.runs: dict[str, builtins.list[Run]] = {}
        # Running experiments per box, as its telemetry's activity counts them; a drop
        # means one ended, and the app says so (the laptop's `devbox run` may be gone).
        self.run_counts: dict[str, int] = {}
        self.runs_ended: set[str] = set()

    def set_boxes(self, boxes: builtins.list[Box]) -> None:
        names = {b.name for b in boxes}
        if names != self.views.keys():
            self.boxes_changed = True  # rows come or go: the table is rebuilt
        for gone in self.views.keys() - names:
            del self.views[gone]
        for box in boxes:
            view = self.views.get(box.name)
            if view is None:
                self.views[box.name] = BoxView(box)
            elif view.box != box:
                view.box = box
            else:
                continue
            self.dirty.add(box.name)

    def frame(self, name: str, frame: protocol.Frame) -> None:
        view = self.views.get(name)
        if view is None:
            return
        if frame.type == protocol.HISTORY:
            view.add_history(frame.body.get("samples", []))
        elif frame.type == protocol.SAMPLE:
            view.add(protocol.sample(frame))
            self._count_runs(name, frame.body.get("activity", {}).get("runs"))
        view.link = "live"
        self.dirty.add(name)

    def link(self, name: str, state: str) -> None:
        view = self.views.get(name)
        if view is not None and view.link != state:
            view.link = state
            self.dirty.add(name)

    def _count_runs(self, name: str, count: object) -> None:
        if not isinstance(count, int):
            return  # an agent older than `devbox run`
        if count < self.run_counts.get(name, 0):
            self.runs_ended.add(name)
        self.run_counts[name] = count

    def set_runs(self, name: str, runs: builtins.list[Run]) -> None:
        if self.runs.get(name) != runs:
            self.runs[name] = runs
            self.dirty.add(name)

    def take_runs_ended(self) -> set[str]:
        ended, self.runs_ended = self.runs_ended, set()
        return ended

    def probe_frame(self, name: str, frame: protocol.Frame) -> None:
        model = self.models.setdefault(name, ModelView())
        model.add(frame)
        model.link = "live"
        self.dirty.add(name)

    def probe_link(self, name: str, state: str) -> None:
        model = self.models.setdefault(name, ModelView())
        if model.link != state:
            model.link = state
            self.dirty.add(name)

    def take_dirty(self) -> set[str]:
        dirty, self.dirty = self.dirty, set()
        return dirty
