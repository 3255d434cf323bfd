"""The models training in one box (devbox.probe): a table of layers with live statistics
and a sparkline of each one's gradient norm, the selected layer's activation histogram over
time (newest at the bottom), and the alerts (NaN/Inf, exploding or vanishing gradients,
dead units)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.markup import escape
from textual.widgets import DataTable, Footer, Header, Label, Static

from devbox.views.probe import HEAD, layer_cells, num
from tui import messages
from tui.feed import ModelView, Store
from tui.screens.base import AppScreen, ScreenContext
from tui.widgets.text import spark

# devbox.views.probe's columns, with the gradient norm's history after its value
COLUMNS = ("PID", "LAYER", *HEAD[:7], "GRAD HISTORY", *HEAD[7:])
SHADES = " ░▒▓█"


def heat(counts: list[int], width: int) -> str:
    """One histogram as a row of shades, `width` cells (bins merged or spread to fit)."""
    if not counts:
        return ""
    cells = [counts[i * len(counts) // width] for i in range(width)]
    top = max(cells) or 1
    last = len(SHADES) - 1
    return "".join(SHADES[min(last, round(last * c / top))] for c in cells)


class ModelScreen(AppScreen):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, context: ScreenContext, name: str) -> None:
        super().__init__(context)
        self.box_name = name
        self.rows: list[tuple[int, str]] = []  # (pid, layer) per table row
        self.ready = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="model-summary")
        yield DataTable(id="layers", cursor_type="row")
        yield Label("histogram of the selected layer's output over time", classes="section")
        yield Static(id="histogram")
        yield Static(id="alerts")
        yield Footer()

    def on_mount(self) -> None:
        self.ready = True
        self.title = f"model in box {self.box_name}"
        table = self.query_one("#layers", DataTable)
        table.add_columns(*COLUMNS)
        self.show(self.context.store, {self.box_name}, relist=True)

    def on_unmount(self) -> None:
        self.ready = False
        self.app.post_message(messages.CloseModel(self.box_name))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        model = self.context.store.models.get(self.box_name)
        if model is not None and 0 <= event.cursor_row < len(self.rows):
            chosen = self.rows[event.cursor_row]
            if model.selected != chosen:
                model.selected = chosen
                model.histograms.clear()  # the old layer's rows mean nothing now

    def show(self, store: Store, dirty: set[str], *, relist: bool) -> None:
        if not self.ready or (self.box_name not in dirty and not relist):
            return
        model = store.models.get(self.box_name)
        summary = self.query_one("#model-summary", Static)
        if model is None:
            summary.update(f"[b]{self.box_name}[/b]  probe: connecting")
            return
        # Each process with what its probe hooks and runs ("[keras/jax] python train.py"),
        # escaped: the label's brackets are not markup.
        steps = ", ".join(
            f"pid {pid} step {s['step']} {escape(model.processes.get(pid, '')[:48])}".rstrip()
            for pid, s in sorted(model.stats.items())
        )
        waiting = "" if model.processes else "  no training process uses devbox.probe yet"
        summary.update(f"[b]{self.box_name}[/b]  probe: {model.link}  {steps}{waiting}")
        self._layers(model)
        self._histogram(model)
        self._alerts(model)

    def _layers(self, model: ModelView) -> None:
        table = self.query_one("#layers", DataTable)
        rows = [(pid, s["name"]) for pid, st in sorted(model.stats.items()) for s in st["layers"]]
        if rows != self.rows:
            table.clear()
            self.rows = rows
            for pid, name in rows:
                table.add_row(*([""] * 12), key=f"{pid}/{name}")
            if model.selected is None and rows:
                model.selected = rows[0]
        for pid, stats in model.stats.items():
            for s in stats["layers"]:
                history = list(model.grad_history.get((pid, s["name"]), ()))
                top = max(history, default=0.0) or 1.0
                cells = layer_cells(s)
                bad = s["act_nan"] + s["act_inf"] + s["grad_nan"]
                if bad:
                    cells[5] = f"[red]{cells[5]}[/red]"
                spark_cell = spark(history, width=16, top=top)
                values = [str(pid), s["name"], *cells[:7], spark_cell, *cells[7:]]
                key = f"{pid}/{s['name']}"
                for column, value in zip(table.columns, values, strict=True):
                    table.update_cell(key, column, value)

    def _histogram(self, model: ModelView) -> None:
        box = self.query_one("#histogram", Static)
        if model.selected is None:
            box.update("select a layer")
            return
        pid, layer = model.selected
        if not model.histograms:
            box.update(f"{layer} (pid {pid}): waiting for its next step")
            return
        lines = [
            f"step {step:>7}  {num(low):>9} {heat(counts, 60)} {num(high)}"
            for step, counts, low, high in model.histograms
        ]
        box.update(f"{layer} (pid {pid})\n" + "\n".join(lines))

    def _alerts(self, model: ModelView) -> None:
        lines = [f"[red]ALERT[/red] {a['kind']}: {a['message']}" for a in model.alerts[-8:]]
        self.query_one("#alerts", Static).update("\n".join(lines) or "no alerts")
