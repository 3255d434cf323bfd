"""One box: per-GPU charts over the recent history, the processes on its GPUs and in the
box, its host figures, and its `devbox run` experiments (open a log, attach one). The model
screen (m) opens from here."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

from devbox import protocol
from devbox.boxes import hung_note
from devbox.runs.record import Run
from tui import messages
from tui.feed import BoxView, Store
from tui.screens.base import AppScreen, ScreenContext
from tui.widgets.text import age, pct, release_hint, size

CHARTS = ("util", "mem", "power", "temp")
TOP_PROCESSES = 30


class GpuPanel(Vertical):
    """One GPU: a title line and four sparklines (utilisation, memory, power, temperature)."""

    def __init__(self, index: int) -> None:
        super().__init__(id=f"gpu-{index}", classes="gpu")
        self.index = index
        # Held, not queried: a redraw may come while the panel is still being mounted.
        self.title = Label(f"GPU {index}", classes="gpu-title")
        self.charts = {
            chart: Sparkline([], id=f"gpu-{index}-{chart}", classes=f"chart {chart}")
            for chart in CHARTS
        }

    def compose(self) -> ComposeResult:
        yield self.title
        for chart, sparkline in self.charts.items():
            with Horizontal(classes="chart-row"):
                yield Label(chart, classes="chart-label")
                yield sparkline

    def show(self, view: BoxView) -> None:
        sample = view.sample
        gpu = (
            next((g for g in sample["gpus"] if g["index"] == self.index), None) if sample else None
        )
        title = self.title
        if gpu is None:
            title.update(f"GPU {self.index}: no sample yet")
        elif gpu["lost"]:
            title.update(f"GPU {self.index} {gpu['name']}: LOST")
        else:
            power = "-" if gpu["power_w"] is None else f"{gpu['power_w']:.0f}W"
            temp = "-" if gpu["temp_c"] is None else f"{gpu['temp_c']:.0f}C"
            title.update(
                f"GPU {self.index} {gpu['name']}  util {pct(gpu['util'])}  "
                f"mem {size(gpu['mem_used'])}/{size(gpu['mem_total'])}  {power}  {temp}"
            )
        points = list(view.gpu_history.get(self.index, ()))
        for i, sparkline in enumerate(self.charts.values()):
            sparkline.data = [p[i] for p in points]


class BoxScreen(AppScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("s", "enter_box", "Shell"),
        Binding("ctrl+d", "release", "Release"),
        Binding("K", "keep", "Keep 4h"),
        Binding("l", "run_log", "Run log"),
        Binding("a", "attach_run", "Attach run"),
        Binding("m", "model", "Model"),
    ]

    def __init__(self, context: ScreenContext, name: str) -> None:
        super().__init__(context)
        self.box_name = name
        self.gpu_indices: list[int] = []
        self.ready = False
        self.shown_runs: list[Run] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="summary")
        with VerticalScroll():
            yield Grid(id="gpus")
            yield Label("Processes on the GPUs", classes="section")
            yield DataTable(id="gpu-procs", cursor_type="none")
            yield Label("Busiest processes in the box", classes="section")
            yield DataTable(id="procs", cursor_type="none")
            yield Label("Runs (l: log, a: attach)", classes="section")
            yield DataTable(id="runs", cursor_type="row")
        yield Footer()

    def on_unmount(self) -> None:
        self.ready = False

    def on_mount(self) -> None:
        self.ready = True
        self.title = f"box {self.box_name}"
        self.query_one("#gpu-procs", DataTable).add_columns(
            "GPU", "PID", "BOX PID", "KIND", "GPU MEM", "SM", "COMMAND"
        )
        self.query_one("#procs", DataTable).add_columns(
            "PID", "USER", "CPU", "RSS", "THREADS", "COMMAND"
        )
        runs = self.query_one("#runs", DataTable)
        runs.add_columns("RUN", "STATE", "EXIT", "STARTED", "TOOK", "COMMIT", "COMMAND")
        runs.focus(scroll_visible=False)  # up/down pick the run that l and a act on
        self.show(self.context.store, {self.box_name}, relist=True)

    def show(self, store: Store, dirty: set[str], *, relist: bool) -> None:
        if not self.ready:
            return  # the redraw clock can tick between compose and on_mount
        view = store.views.get(self.box_name)
        if view is None:
            self.query_one("#summary", Static).update(f"box {self.box_name} is gone")
            return
        if self.box_name not in dirty and not relist:
            return
        self._summary(view)
        sample = view.sample
        indices = [g["index"] for g in sample["gpus"]] if sample else sorted(view.gpu_history)
        grid = self.query_one("#gpus", Grid)
        if indices != self.gpu_indices:
            grid.remove_children()
            grid.mount_all([GpuPanel(i) for i in indices])
            self.gpu_indices = indices
            self.call_after_refresh(self._show_gpus, view)
        else:
            self._show_gpus(view)
        if sample is not None:
            self._processes(view)
        self._runs(store.runs.get(self.box_name))

    def _show_gpus(self, view: BoxView) -> None:
        for panel in self.query(GpuPanel):
            panel.show(view)

    def _summary(self, view: BoxView) -> None:
        box, sample = view.box, view.sample
        parts = [f"[b]{box.name}[/b]", box.backend, box.state.value, f"telemetry: {view.link}"]
        if sample is not None:
            host = sample["host"]
            cpu = sum(host["cpu"]) / len(host["cpu"]) if host["cpu"] else None
            parts.append(
                f"cpu {pct(cpu)} of {len(host['cpu'])}  "
                f"mem {size(host['mem_used'])}/{size(host['mem_total'])}"
            )
        if sample is not None and "activity" in sample:
            activity = sample["activity"]
            idle = max(0.0, sample["t"] - protocol.last_use(activity))
            parts.append(f"sessions: {activity['clients']} attached, last used {age(idle)} ago")
        if box.reason:
            parts.append(box.reason)
        if view.hung_since:
            parts.append(f"[b]{hung_note(box, view.hung_since, self.context.clock())}[/b]")
        note = box.autoscaler_note(self.context.clock())
        if note:
            parts.append(f"[b]{note}[/b]")
        if box.release_at:
            parts.append(f"[b]{release_hint(box.release_at)}[/b]")
        self.query_one("#summary", Static).update("  ".join(parts))

    def _processes(self, view: BoxView) -> None:
        sample = view.sample
        assert sample is not None
        names = {p["pid"]: p["cmdline"] or p["name"] for p in sample["processes"]}
        gpu_table = self.query_one("#gpu-procs", DataTable)
        gpu_table.clear()
        for g in sample["gpus"]:
            for p in g["processes"]:
                box_pid = p["box_pid"]
                gpu_table.add_row(
                    str(g["index"]),
                    str(p["pid"]),
                    "-" if box_pid is None else str(box_pid),
                    p["kind"],
                    size(p["mem_used"]),
                    pct(p["sm_util"]),
                    names.get(box_pid, "-") if box_pid is not None else "-",
                )
        table = self.query_one("#procs", DataTable)
        table.clear()
        busiest = sorted(
            sample["processes"], key=lambda p: (p["cpu"] or 0.0, p["rss"] or 0), reverse=True
        )
        for proc in busiest[:TOP_PROCESSES]:
            table.add_row(
                str(proc["pid"]),
                proc["user"] or "-",
                pct(proc["cpu"]),
                size(proc["rss"]),
                "-" if proc["threads"] is None else str(proc["threads"]),
                (proc["cmdline"] or proc["name"])[:100],
            )

    def _runs(self, runs: list[Run] | None) -> None:
        if runs is None or runs == self.shown_runs:
            return
        self.shown_runs = runs
        table = self.query_one("#runs", DataTable)
        row = table.cursor_row
        table.clear()
        now = self.context.clock()
        for run in reversed(runs):  # newest first
            took = run.duration(now)
            commit = (run.git_commit or "-")[:10] + ("+" if run.git_dirty else "")
            table.add_row(
                run.id,
                run.state,
                run.outcome(),
                f"{age(now - run.created_at)} ago",
                "-" if took is None else age(took),
                commit,
                run.command[:80],
                key=run.id,
            )
        if runs:
            table.move_cursor(row=min(row, len(runs) - 1))

    def selected_run(self) -> str | None:
        table = self.query_one("#runs", DataTable)
        if not table.row_count:
            self.notify("no runs in this box: `devbox run --box NAME -- CMD` starts one")
            return None
        key = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value
        return str(key) if key is not None else None

    def action_run_log(self) -> None:
        run_id = self.selected_run()
        if run_id is not None:
            self.app.post_message(messages.OpenRunLog(self.box_name, run_id))

    def action_attach_run(self) -> None:
        run_id = self.selected_run()
        if run_id is not None:
            self.app.post_message(messages.AttachRun(self.box_name, run_id))

    def action_enter_box(self) -> None:
        self.app.post_message(messages.EnterBox(self.box_name))

    def action_release(self) -> None:
        self.app.post_message(messages.ReleaseBox(self.box_name))

    def action_keep(self) -> None:
        self.app.post_message(messages.KeepBox(self.box_name))

    def action_model(self) -> None:
        self.app.post_message(messages.OpenModel(self.box_name))
