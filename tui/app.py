"""`devbox tui`: the app, its workers, and the clock that redraws.

Workers (this module) do all I/O through a `Feed` and write into a `Store`; a timer at
`redraw_hz` hands the current screen the names of the boxes that changed since the last
redraw. Between two redraws any number of samples may arrive for a box; only its newest
is drawn. Screens and widgets never do I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from textual import on
from textual.app import App, SuspendNotSupported
from textual.binding import Binding, BindingType
from textual.command import Hit, Hits, Provider
from textual.worker import Worker

from devbox import saves
from devbox.backends.base import Backend
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.errors import DevboxError
from tui import messages
from tui.feed import BackendFeed, Feed, Store, run_attached
from tui.screens.base import AppScreen, ScreenContext
from tui.screens.box import BoxScreen
from tui.screens.boxes import BoxesScreen
from tui.screens.modals import ClaimRequest, ClaimScreen, ConfirmScreen
from tui.screens.model import ModelScreen
from tui.screens.runlog import RunLogScreen
from tui.widgets.text import release_hint

# How long `K` keeps a box against idle release (as `devbox keep` without --for).
KEEP_SECONDS = 4 * 3600.0
# How long a lost telemetry link waits before it tries again, doubling up to the last.
BACKOFF = (0.5, 1.0, 2.0, 5.0, 10.0)
# How often the model screen asks for a fresh histogram of the selected layer.
HISTOGRAM_INTERVAL = 2.0
_LIVE = frozenset({BoxState.RUNNING, BoxState.IDLE})
# How often the open box's runs and an open log are fetched again.
RUNS_INTERVAL = 3.0
# A run that ended longer ago than this is not news when its box's count drops.
ANNOUNCE_WITHIN = 120.0
# The cyclic GC's young-generation threshold while the app runs (CPython's is 700). Every
# sample and every repainted line allocate containers that die young by reference count,
# yet their bursts crossed 700 about 9 times a second at 50 boxes x 10 Hz: 1% of a core in
# collections that found next to nothing, and an occasional full one of 80 ms in the middle
# of a key press (bench_tui.py). Cycles still get collected, a little later.
GC_YOUNG_THRESHOLD = 10_000


class BoxCommands(Provider):
    """The command palette (ctrl+p): open, enter or release any box by name, or claim."""

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, DevboxApp)
        matcher = self.matcher(query)
        commands: list[tuple[str, Callable[[], object], str]] = [
            ("claim a box", app.action_claim, "open the claim dialog")
        ]
        for name in sorted(app.store.views):
            commands += [
                (f"open {name}", partial(app.open_box, name), "GPU charts and processes"),
                (f"shell {name}", partial(app.enter_box, name), "attach its session"),
                (f"release {name}", partial(app.ask_release, name), "asks first; home kept"),
                (f"keep {name}", partial(app.keep_box, name), "hold against idle release 4h"),
            ]
        for text, action, help_text in commands:
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), action, help=help_text)


class DevboxApp(App[None]):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "devbox"
    COMMANDS: ClassVar = App.COMMANDS | {BoxCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(
        self,
        *,
        feed: Feed,
        backend_name: str = "local",
        rate: float = 1.0,
        list_interval: float = 2.0,
        redraw_hz: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.clock = clock  # ages and idle times; tests fix it for snapshots
        self.feed = feed
        self.backend_name = backend_name
        self.rate = rate
        self.list_interval = list_interval
        self.redraw_hz = redraw_hz
        self.store = Store()
        self.context = ScreenContext(store=self.store, clock=self.clock)
        self.streams: dict[str, Worker[None]] = {}
        self.probes: dict[str, Worker[None]] = {}
        self._request_ids = 0
        self._relist = asyncio.Event()
        self.announced: set[tuple[str, str]] = set()  # (box, run) endings already told
        self.warned: dict[str, float] = {}  # box -> the release warning already told
        self.hung: dict[str, float] = {}  # box -> since when it is hung, already told
        self._gc_threshold: tuple[int, int, int] | None = None  # to restore at the end

    def on_mount(self) -> None:
        self.push_screen(BoxesScreen(self.context))
        self.run_worker(self._follow_boxes(), name="boxes", group="boxes")
        self.set_interval(1.0 / self.redraw_hz, self.redraw)
        # Once Textual, the screens and the first samples are built, take them out of the
        # cyclic GC's sight: a full collection walked all of them, and showed as the slow
        # tail of key-press latency (p99 125 ms against a 6 ms median, bench_tui.py).
        self.set_timer(3.0, gc.freeze)
        self._gc_threshold = gc.get_threshold()
        _, *older = self._gc_threshold
        gc.set_threshold(max(GC_YOUNG_THRESHOLD, self._gc_threshold[0]), *older)

    def on_unmount(self) -> None:
        if self._gc_threshold is not None:  # the process (a test run) goes on as it was
            gc.set_threshold(*self._gc_threshold)

    # --- the redraw clock ----------------------------------------------------------

    def redraw(self) -> None:
        for name in self.store.take_runs_ended():
            self.run_worker(self._announce_ended(name), name=f"ended {name}", group="runs-ended")
        relist, self.store.boxes_changed = self.store.boxes_changed, False
        dirty = self.store.take_dirty()
        if not (dirty or relist) or not self.is_running or not self.screen_stack:
            return  # nothing new, or the app is shutting down (its screens go first)
        screen = self.screen
        if isinstance(screen, AppScreen):  # not a modal
            screen.show(self.store, dirty, relist=relist)

    # --- workers: boxes and their telemetry -----------------------------------------

    async def _follow_boxes(self) -> None:
        while True:
            try:
                boxes = await self.feed.boxes()
            except DevboxError as exc:
                if self.store.problem != exc.message:
                    self.store.problem = exc.message
                    self.store.boxes_changed = True  # the title says what is wrong
            else:
                # A cluster that did not answer is said in the title; the others' boxes show.
                problem = "; ".join(self.feed.problems()) or None
                if self.store.problem != problem:
                    self.store.problem, self.store.boxes_changed = problem, True
                self._announce_warnings(boxes)
                self.store.set_boxes(boxes)
                self._sync_streams(boxes)
            self._relist.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._relist.wait(), self.list_interval)

    def _announce_warnings(self, boxes: list[Box]) -> None:
        """A toast for each new release warning, whichever screen is open: the table's
        "warned" is easy to miss on the model screen."""
        warned = {b.name: b.release_at for b in boxes if b.release_at}
        for name, release_at in warned.items():
            if self.warned.get(name) != release_at:
                self.notify(
                    f"box {name} {release_hint(release_at)} (on its row or screen)",
                    title="release warning",
                    severity="warning",
                    timeout=30,
                )
        self.warned = warned
        # A box that turned hung (devbox.hang): a toast too, once per hang.
        hung = {b.name: b.hung_since for b in boxes if b.hung_since}
        for name, since in hung.items():
            if self.hung.get(name) != since:
                self.notify(
                    f"box {name} looks hung: GPUs busy at low power, no training step; "
                    f"`devbox probe {name} --stacks` shows where it waits",
                    title="hung",
                    severity="error",
                    timeout=30,
                )
        self.hung = hung

    def _sync_streams(self, boxes: list[Box]) -> None:
        live = {b.name: b for b in boxes if b.state in _LIVE}
        for name in list(self.streams):
            if name not in live:
                self.streams.pop(name).cancel()
        for name, box in live.items():
            if name not in self.streams:
                self.streams[name] = self.run_worker(
                    self._stream(box), name=f"stream {name}", group="streams"
                )

    async def _stream(self, box: Box) -> None:
        """Follow one box's telemetry for as long as the box lives."""
        # Looked up at each call, not bound once: tests swap the store's methods.
        await self._follow(
            box,
            lambda b: self.feed.stream(b, rate=self.rate),
            lambda name, frame: self.store.frame(name, frame),
            lambda name, state: self.store.link(name, state),
        )

    async def _follow(
        self,
        box: Box,
        frames_of: Callable[[Box], AsyncIterator[Any]],
        on_frame: Callable[[str, Any], None],
        on_link: Callable[[str, str], None],
    ) -> None:
        """Follow one of a box's streams until cancelled; reconnect on loss."""
        attempt = 0
        while True:
            on_link(box.name, "connecting")
            view = self.store.views.get(box.name)
            if view is not None:
                box = view.box  # the newest record: an agent restarted elsewhere has moved
            try:
                async for frame in frames_of(box):
                    on_frame(box.name, frame)
                    attempt = 0
                reason = "the stream ended"
            except DevboxError as exc:
                reason = exc.message
            except Exception as exc:
                # Whatever one box's stream raises is that box's state, never the app's
                # end: an uncaught error here quit the dashboard for every box.
                self.log.error(f"stream of box {box.name} failed: {exc!r}")  # textual console
                reason = str(exc) or type(exc).__name__
            on_link(box.name, f"lost: {reason}")
            await asyncio.sleep(BACKOFF[min(attempt, len(BACKOFF) - 1)])
            attempt += 1

    def relist(self) -> None:
        self._relist.set()

    # --- the model screen's stream (devbox.probe), only while that screen is open -------

    def open_model(self, name: str) -> None:
        view = self.store.views.get(name)
        if view is None or view.box.state not in _LIVE:
            self.notify(f"box {name} is not running", severity="warning")
            return
        if name not in self.probes:
            self.probes[name] = self.run_worker(
                self._probe(view.box), name=f"probe {name}", group="probes"
            )
        self.push_screen(ModelScreen(self.context, name))

    def close_model(self, name: str) -> None:
        worker = self.probes.pop(name, None)
        if worker is not None:
            worker.cancel()

    async def _probe(self, box: Box) -> None:
        async def frames_of(box: Box) -> AsyncIterator[Any]:
            outbox: asyncio.Queue[Any] = asyncio.Queue()
            asker = asyncio.ensure_future(self._ask_histograms(box.name, outbox))
            try:
                async for frame in self.feed.probe(box, outbox=outbox):
                    yield frame
            finally:
                asker.cancel()

        await self._follow(box, frames_of, self.store.probe_frame, self.store.probe_link)

    async def _ask_histograms(self, name: str, outbox: asyncio.Queue[Any]) -> None:
        """The selected layer's activation histogram, every HISTOGRAM_INTERVAL seconds."""
        while True:
            model = self.store.models.get(name)
            if model is not None and model.selected is not None:
                pid, layer = model.selected
                self._request_ids += 1
                outbox.put_nowait(
                    {
                        "id": self._request_ids,
                        "kind": "histogram",
                        "layer": layer,
                        "tensor": "activation",
                        "bins": 40,
                        "pid": pid,
                    }
                )
            await asyncio.sleep(HISTOGRAM_INTERVAL)

    # --- actions (screens call these; the work runs in workers) ----------------------

    def open_box(self, name: str) -> None:
        self.push_screen(BoxScreen(self.context, name))
        self.run_worker(self._follow_runs(name), name=f"runs {name}", group="runs", exclusive=True)

    # --- runs: `devbox run` experiments of the open box ------------------------------

    def _showing(self, kind: type[BoxScreen | RunLogScreen], name: str) -> bool:
        return any(isinstance(s, kind) and s.box_name == name for s in self.screen_stack)

    async def _follow_runs(self, name: str) -> None:
        """The open box's runs, every few seconds while its screen is in the stack."""
        while self._showing(BoxScreen, name):
            view = self.store.views.get(name)
            if view is not None and view.box.state in _LIVE:
                try:
                    self.store.set_runs(name, await self.feed.runs(view.box))
                except DevboxError as exc:
                    self.notify(exc.message, title="runs", severity="warning", timeout=5)
                    return
            await asyncio.sleep(RUNS_INTERVAL)

    def open_run_log(self, name: str, run_id: str) -> None:
        screen = RunLogScreen(self.context, name, run_id)
        self.push_screen(screen)
        self.run_worker(self._follow_log(screen), name=f"log {run_id}", group="log", exclusive=True)

    async def _follow_log(self, screen: RunLogScreen) -> None:
        while screen in self.screen_stack:
            view = self.store.views.get(screen.box_name)
            if view is None:
                return
            try:
                text = await self.feed.run_log(view.box, screen.run_id)
            except DevboxError as exc:
                self.notify(exc.message, title="log", severity="error", timeout=10)
                return
            screen.show_log(text)
            runs = {r.id: r for r in self.store.runs.get(screen.box_name, [])}
            run = runs.get(screen.run_id)
            if run is not None and run.finished:
                return  # an ended run's log does not change
            await asyncio.sleep(RUNS_INTERVAL)

    def attach_run(self, name: str, run_id: str) -> None:
        self._hand_over(
            name,
            lambda box: self.feed.attach_argv(box, run_id),
            what="a run",
            failed=lambda status: f"cannot attach run {run_id} (status {status})",
        )

    async def _announce_ended(self, name: str) -> None:
        """A box's count of running experiments dropped: say which ended, and how."""
        view = self.store.views.get(name)
        if view is None:
            return
        try:
            runs = await self.feed.runs(view.box)
        except DevboxError:
            return
        self.store.set_runs(name, runs)
        for run in runs:
            key = (name, run.id)
            if run.finished and key not in self.announced and run.ended_at is not None:
                self.announced.add(key)
                if self.clock() - run.ended_at < ANNOUNCE_WITHIN:
                    self.notify(
                        f"run {run.id} on {name} {run.state} ({run.outcome()}): {run.command}",
                        title="run ended",
                        severity="information" if run.state == "done" else "warning",
                        timeout=15,
                    )

    def enter_box(self, name: str) -> None:
        self._hand_over(
            name,
            lambda box: self.feed.enter_argv(box),
            what="a session",
            failed=lambda status: f"the session of {name} ended with status {status}",
        )

    def _hand_over(
        self,
        name: str,
        argv_for: Callable[[Box], list[str]],
        *,
        what: str,
        failed: Callable[[int], str],
    ) -> None:
        """Suspend the app and give the terminal to `argv_for(box)` until it returns."""
        view = self.store.views.get(name)
        if view is None or view.box.state not in _LIVE:
            self.notify(f"box {name} is not running", severity="warning")
            return
        argv = argv_for(view.box)
        try:
            with self.suspend():
                status = run_attached(argv)
        except SuspendNotSupported:
            self.notify(f"this terminal cannot hand over to {what}", severity="error")
            return
        if status not in (0, 130):
            self.notify(failed(status), severity="warning")
        self.refresh()

    def action_claim(self) -> None:
        self.push_screen(ClaimScreen(backend=self.backend_name), self._claim_chosen)

    def _claim_chosen(self, request: ClaimRequest | None) -> None:
        if request is not None:
            self.run_worker(self._claim(request), name="claim", group="actions")

    async def _claim(self, request: ClaimRequest) -> None:
        label = request.name or "a box"
        self.notify(f"claiming {label} ({request.gpus} GPUs, {request.backend})...")
        try:
            box = await self.feed.claim(
                BoxSpec(gpus=request.gpus, profile=request.profile),
                name=request.name,
                backend=request.backend,
            )
        except DevboxError as exc:
            self.notify(exc.message, title="claim failed", severity="error", timeout=10)
            return
        self.notify(f"box {box.name} is up; s opens its session")
        self.relist()

    def ask_release(self, name: str) -> None:
        self.push_screen(
            ConfirmScreen(f"Release box {name}? Its home is kept."),
            partial(self._release_chosen, name),
        )

    def _release_chosen(self, name: str, yes: bool | None) -> None:
        view = self.store.views.get(name)
        if yes and view is not None:
            self.run_worker(self._release(view.box), name="release", group="actions")

    async def _release(self, box: Box) -> None:
        self.notify(f"releasing box {box.name}: its probed processes save first")
        try:
            results = await self.feed.release(box)
        except DevboxError as exc:
            self.notify(exc.message, title="release failed", severity="error", timeout=10)
            return
        said = "".join(f"\n{saves.line(r)}" for r in results)
        self.notify(f"box {box.name} released (its home is kept){said}", timeout=10 if said else 5)
        if isinstance(self.screen, BoxScreen) and self.screen.box_name == box.name:
            self.pop_screen()
        self.relist()

    def keep_box(self, name: str) -> None:
        view = self.store.views.get(name)
        if view is not None:
            self.run_worker(self._keep(view.box), name="keep", group="actions")

    async def _keep(self, box: Box) -> None:
        until = self.clock() + KEEP_SECONDS
        try:
            kept = await self.feed.keep(box, until=until)
        except DevboxError as exc:
            self.notify(exc.message, title="keep failed", severity="error", timeout=10)
            return
        clock = time.strftime("%a %H:%M", time.localtime(kept.keep_until))
        self.notify(f"box {box.name} is kept until {clock}")
        self.relist()

    # --- what the screens ask (tui.messages) ---------------------------------------

    @on(messages.OpenBox)
    def _on_open_box(self, message: messages.OpenBox) -> None:
        self.open_box(message.box)

    @on(messages.EnterBox)
    def _on_enter_box(self, message: messages.EnterBox) -> None:
        self.enter_box(message.box)

    @on(messages.ReleaseBox)
    def _on_release_box(self, message: messages.ReleaseBox) -> None:
        self.ask_release(message.box)

    @on(messages.KeepBox)
    def _on_keep_box(self, message: messages.KeepBox) -> None:
        self.keep_box(message.box)

    @on(messages.OpenModel)
    def _on_open_model(self, message: messages.OpenModel) -> None:
        self.open_model(message.box)

    @on(messages.CloseModel)
    def _on_close_model(self, message: messages.CloseModel) -> None:
        self.close_model(message.box)

    @on(messages.OpenRunLog)
    def _on_open_run_log(self, message: messages.OpenRunLog) -> None:
        self.open_run_log(message.box, message.run_id)

    @on(messages.AttachRun)
    def _on_attach_run(self, message: messages.AttachRun) -> None:
        self.attach_run(message.box, message.run_id)

    @on(messages.ClaimBox)
    def _on_claim_box(self, message: messages.ClaimBox) -> None:
        self.action_claim()

    def action_help(self) -> None:
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()


def make_app(
    *,
    backend: Backend | None = None,
    feed: Feed | None = None,
    cli_flags: Sequence[str] = (),
    **options: Any,
) -> DevboxApp:
    """The dashboard for `backend` (the real thing) or `feed` (tests, benchmarks, demos)."""
    if feed is None:
        if backend is None:
            raise ValueError("make_app needs a backend or a feed")
        feed = BackendFeed(backend, cli_flags=cli_flags)
    name = backend.name if backend is not None else "local"
    return DevboxApp(feed=feed, backend_name=name, **options)
