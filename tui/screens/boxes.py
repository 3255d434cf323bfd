"""The boxes screen: every box in a table with a live GPU sparkline, a filter, and the
selected box's detail below."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Footer, Header, Input, Static

from devbox.boxes import hung_note
from devbox.protocol import Sample
from tui import messages
from tui.feed import BoxView, Store
from tui.screens.base import AppScreen, ScreenContext
from tui.widgets.boxtable import BoxTable
from tui.widgets.text import age, pct, release_hint, size, spark

DETAIL_HZ = 2.0
COLUMNS = (
    "NAME",
    "WHERE",  # the backend, or the box's cluster where the user has several
    "STATE",
    "OWNER",
    "GPUS",
    "GPU UTIL",
    "UTIL",
    "GPU MEM",
    "IDLE",
    "AGE",
)


class Sparks:
    """Each box's sparkline, drawn again only when its history took a point (1 Hz), not
    for every sample that dirties its row (up to 10 Hz): half of a row's formatting."""

    def __init__(self) -> None:
        self._drawn: dict[str, tuple[BoxView, int, str]] = {}

    def of(self, view: BoxView) -> str:
        drawn = self._drawn.get(view.box.name)
        if drawn is not None and drawn[0] is view and drawn[1] == view.recorded:
            return drawn[2]
        text = spark(view.util)
        self._drawn[view.box.name] = (view, view.recorded, text)
        return text

    def keep(self, names: set[str]) -> None:
        """Forget the boxes that are gone."""
        self._drawn = {k: v for k, v in self._drawn.items() if k in names}


class Rows:
    """Each box's cells as last formatted, and what they were formatted from. A box whose
    new sample brought the same GPU figures, with the same record, link and history, and
    whose ages read the same, keeps its cells as they were: an idle lab's every sample."""

    def __init__(self) -> None:
        self.sparks = Sparks()
        self._made: dict[str, tuple[tuple[object, ...], tuple[str, ...]]] = {}

    def of(self, view: BoxView, now: float) -> tuple[str, ...]:
        box = view.box
        # Everything the row shows is made from these. The view first: a box that went
        # and came back under its name is a new view (compared by identity first, so this
        # costs nothing). The GPUs' figures as the row sums them: comparing the samples'
        # GPU lists instead cost four times as much.
        inputs = (
            view,
            box,
            view.link,
            view.recorded,
            view.hung_since,
            gpu_figures(view.sample),
            age(box.idle_seconds(now)),
            age(now - box.created_at) if box.created_at else "-",
        )
        made = self._made.get(box.name)
        if made is not None and made[0] == inputs:
            return made[1]
        cells = _cells(view, inputs[5], inputs[6], inputs[7], self.sparks.of(view))
        self._made[box.name] = (inputs, cells)
        return cells

    def keep(self, names: set[str]) -> None:
        """Forget the boxes that are gone."""
        self._made = {k: v for k, v in self._made.items() if k in names}
        self.sparks.keep(names)


def gpu_figures(sample: Sample | None) -> tuple[int, int, float | None]:
    """A sample's GPU memory used and total, summed, and its mean utilisation (None: no
    GPU reports one), in one pass (this runs for every box that changed, every frame)."""
    used = total = 0
    if sample is None or not sample["gpus"]:
        return used, total, None
    utils: list[float] = []
    for g in sample["gpus"]:
        used += g["mem_used"] or 0
        total += g["mem_total"] or 0
        if g["util"] is not None:
            utils.append(g["util"])
    return used, total, sum(utils) / len(utils) if utils else None


def row(view: BoxView, now: float) -> tuple[str, ...]:
    """The table's cells for one box."""
    box = view.box
    return _cells(
        view,
        gpu_figures(view.sample),
        age(box.idle_seconds(now)),
        age(now - box.created_at) if box.created_at else "-",
        spark(view.util),
    )


def _cells(
    view: BoxView,
    figures: tuple[int, int, float | None],
    idle: str,
    age_text: str,
    sparkline: str,
) -> tuple[str, ...]:
    box = view.box
    used, total, util = figures
    state = box.state.value if view.link == "live" or box.state.value != "running" else view.link
    # The autoscaler's word outranks the link: a user must see it in the table.
    if box.unhealthy_since:
        state = "unhealthy"
    elif view.hung_since and box.state.value == "running":
        state = "hung"  # busy-looking GPUs that do nothing: before any release warning
    elif box.release_at:
        state = "warned"
    return (
        box.name,
        box.cluster or box.backend,
        state.split(":")[0],
        box.owner,
        str(box.spec.gpus),
        sparkline if box.spec.gpus else "",
        pct(util) if box.spec.gpus else "",
        f"{size(used)}/{size(total)}" if total else "-",
        idle,
        age_text,
    )


def detail(view: BoxView | None, now: float) -> str:
    if view is None:
        return "No box selected. c claims one."
    box, sample = view.box, view.sample
    where = f"{box.backend} cluster {box.cluster}" if box.cluster else box.backend
    lines = [f"[b]{box.name}[/b]  {where}  {box.state.value}  telemetry: {view.link}"]
    if box.keep_until:
        lines[0] += f"  kept until {time.strftime('%a %H:%M', time.localtime(box.keep_until))}"
    if box.reason:
        lines.append(box.reason)
    if view.hung_since:
        lines.append(f"[b]{hung_note(box, view.hung_since, now)}[/b]")
    note = box.autoscaler_note(now)
    if note:
        lines.append(f"[b]{note}[/b]  (`devbox explain {box.name}` says why)")
    if box.release_at:
        lines.append(f"[b]{release_hint(box.release_at)}[/b]")
    if sample is None:
        return "\n".join(lines)
    for g in sample["gpus"]:
        if g["lost"]:
            lines.append(f"GPU {g['index']} {g['name']}: LOST")
            continue
        power = "-" if g["power_w"] is None else f"{g['power_w']:.0f} W"
        temp = "-" if g["temp_c"] is None else f"{g['temp_c']:.0f} C"
        lines.append(
            f"GPU {g['index']} {g['name']}: util {pct(g['util'])}  "
            f"mem {size(g['mem_used'])}/{size(g['mem_total'])}  {power}  {temp}  "
            f"{len(g['processes'])} proc"
        )
    host = sample["host"]
    cpu = sum(host["cpu"]) / len(host["cpu"]) if host["cpu"] else None
    lines.append(
        f"host cpu {pct(cpu)}  mem {size(host['mem_used'])}/{size(host['mem_total'])}  "
        f"{len(sample['processes'])} processes"
    )
    return "\n".join(lines)


class BoxesScreen(AppScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "open", "Open"),
        Binding("s", "enter_box", "Shell"),
        Binding("c", "claim", "Claim"),
        Binding("ctrl+d", "release", "Release"),
        Binding("K", "keep", "Keep 4h"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
    ]

    def __init__(self, context: ScreenContext) -> None:
        super().__init__(context)
        self.filter_text = ""
        self.shown: list[str] = []  # box names in table order
        self.ready = False
        self._detail_of: str | None = None
        self._detail_at = 0.0
        self._detail_text: str | None = None
        self.rows = Rows()

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(placeholder="filter: part of a name, state, owner or backend", id="filter")
        # Kept, not queried: show() runs on every redraw and reads both.
        self.table = BoxTable(COLUMNS, id="boxes")
        self.detail_panel = Static(id="detail")
        yield self.table.header
        yield self.table
        yield self.detail_panel
        yield Footer()

    def on_unmount(self) -> None:
        self.ready = False

    def on_mount(self) -> None:
        table = self.query_one("#boxes", BoxTable)
        self.query_one("#filter", Input).display = False
        table.focus()
        self.ready = True
        self.show(self.context.store, set(self.context.store.views), relist=True)

    # --- data in ------------------------------------------------------------------

    def matches(self, view: BoxView) -> bool:
        if not self.filter_text:
            return True
        box = view.box
        hay = f"{box.name} {box.state.value} {box.owner} {box.backend} {box.cluster}".lower()
        return self.filter_text.lower() in hay

    def show(self, store: Store, dirty: set[str], *, relist: bool) -> None:
        """Redraw what changed: rows of dirty boxes, or the whole table when the set of
        boxes (or the filter) changed."""
        if not self.ready:
            return  # the redraw clock can tick between compose and on_mount
        table = self.table
        now = self.context.clock()
        wanted = sorted(n for n, v in store.views.items() if self.matches(v))
        rows, views = self.rows, store.views
        if relist or wanted != self.shown:
            rows.keep(set(views))
            table.set_rows([(name, rows.of(views[name], now)) for name in wanted])
            self.shown = wanted
        else:
            on_table = set(wanted)
            table.update_rows({name: rows.of(views[name], now) for name in dirty & on_table})
        if relist or self.selected_name() in dirty:
            self.show_detail(now=relist)
        count = len(store.views)
        shown = f"{count} box" + ("" if count == 1 else "es")
        # What could not be read (the list, or one cluster of several) beside what could.
        self.sub_title = f"{shown}; {store.problem}" if store.problem else shown

    def show_detail(self, *, now: bool = True) -> None:
        """The selected box's detail: at once when the selection changes, else at most
        DETAIL_HZ (a dozen lines that would otherwise repaint on every sample of it)."""
        name = self.selected_name()
        clock = time.monotonic()
        if not now and name == self._detail_of and clock - self._detail_at < 1 / DETAIL_HZ:
            return
        self._detail_of, self._detail_at = name, clock
        view = self.context.store.views.get(name) if name else None
        text = detail(view, self.context.clock())
        if text == self._detail_text:
            return  # the same lines: repainting them is all cost (an idle box, every 0.5 s)
        self._detail_text = text
        # Fixed height (app.tcss): new text never changes the layout of the screen.
        self.detail_panel.update(text, layout=False)

    def selected_name(self) -> str | None:
        return self.table.cursor_key

    def on_box_table_row_highlighted(self, event: BoxTable.RowHighlighted) -> None:
        self.show_detail()

    def on_box_table_row_selected(self, event: BoxTable.RowSelected) -> None:
        self.action_open()

    # --- filter -------------------------------------------------------------------

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.show(self.context.store, set(), relist=False)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#boxes", BoxTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.filter_text = ""
        self.query_one("#boxes", BoxTable).focus()
        self.show(self.context.store, set(), relist=False)

    # --- actions: all through the app, which owns the workers -----------------------

    def action_cursor_down(self) -> None:
        self.query_one("#boxes", BoxTable).action_cursor(1)

    def action_cursor_up(self) -> None:
        self.query_one("#boxes", BoxTable).action_cursor(-1)

    def action_open(self) -> None:
        if name := self.selected_name():
            self.app.post_message(messages.OpenBox(name))

    def action_enter_box(self) -> None:
        if name := self.selected_name():
            self.app.post_message(messages.EnterBox(name))

    def action_claim(self) -> None:
        self.app.post_message(messages.ClaimBox())

    def action_release(self) -> None:
        if name := self.selected_name():
            self.app.post_message(messages.ReleaseBox(name))

    def action_keep(self) -> None:
        if name := self.selected_name():
            self.app.post_message(messages.KeepBox(name))
