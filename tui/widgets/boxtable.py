"""The boxes table: one line per box, drawn line by line.

Why not Textual's DataTable: any cell update there re-renders every visible cell
(its render cache is keyed by a widget-wide update counter), which at 50 boxes
streaming at 10 Hz cost most of a core and kept key presses waiting behind
70-110 ms frames (benchmarks/bench_tui.py). Here a row that changed repaints that
one line, a cursor move repaints two, and an unchanged row is a cached Strip.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

PAD = 2  # spaces between columns


def layout(cells: Sequence[str], widths: Sequence[int]) -> str:
    return " " + (" " * PAD).join(c[:w].ljust(w) for c, w in zip(cells, widths, strict=True))


class TableHeader(Static):
    """The column titles, above the table (which scrolls under it)."""

    DEFAULT_CSS = """
    TableHeader { height: 1; text-style: bold; background: $panel; }
    """


class BoxTable(ScrollView, can_focus=True):
    COMPONENT_CLASSES: ClassVar[set[str]] = {"box-table--cursor", "box-table--odd"}
    DEFAULT_CSS = """
    BoxTable { height: 1fr; }
    BoxTable > .box-table--cursor { background: $accent; color: $text; text-style: bold; }
    BoxTable:blur > .box-table--cursor { background: $accent 50%; }
    BoxTable > .box-table--odd { background: $surface-lighten-1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("home", "jump(0)", show=False),
        Binding("end", "jump(-1)", show=False),
        Binding("enter", "select", "Open", show=False),
    ]

    class RowHighlighted(Message):
        def __init__(self, key: str | None) -> None:
            super().__init__()
            self.key = key

    class RowSelected(Message):
        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    def __init__(self, columns: Sequence[str], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.columns = tuple(columns)
        self.widths = [len(c) for c in self.columns]
        self.keys: list[str] = []
        self.rows: dict[str, tuple[str, ...]] = {}
        self._index: dict[str, int] = {}  # key -> its line
        self.cursor = 0
        # key -> (cells, cursor?, odd?, width) and the Strip drawn for them.
        self._strips: dict[str, tuple[tuple[object, ...], Strip]] = {}
        self.header = TableHeader(layout(self.columns, self.widths))
        self._line_styles: tuple[Style, Style, Style] | None = None

    # --- data in ------------------------------------------------------------------

    @property
    def cursor_key(self) -> str | None:
        return self.keys[self.cursor] if 0 <= self.cursor < len(self.keys) else None

    def cell(self, key: str, column: str) -> str:
        return self.rows[key][self.columns.index(column)]

    def set_rows(self, rows: Sequence[tuple[str, tuple[str, ...]]]) -> None:
        """Replace every row (boxes came or went, or the filter changed); the cursor stays
        on the same box when it is still there."""
        keep = self.cursor_key
        self.keys = [key for key, _ in rows]
        self.rows = dict(rows)
        self._index = {key: i for i, key in enumerate(self.keys)}
        self._strips = {k: v for k, v in self._strips.items() if k in self.rows}
        self._fit(self.rows.values())
        if keep in self.rows:
            self.cursor = self.keys.index(keep)
        self.cursor = max(0, min(self.cursor, len(self.keys) - 1))
        self.virtual_size = Size(self._line_width(), len(self.keys))
        self.refresh()
        if self.cursor_key != keep:
            self.post_message(self.RowHighlighted(self.cursor_key))

    def update_rows(self, rows: Mapping[str, tuple[str, ...]]) -> None:
        """New values for some boxes: a line is repainted only if something in it changed
        and it is on screen, and all of them in one refresh (each refresh call walks the
        widget's geometry: 50 of them per frame showed in the profile)."""
        changed = [
            key for key, cells in rows.items() if key in self.rows and self.rows[key] != cells
        ]
        if not changed:
            return
        for key in changed:
            self.rows[key] = rows[key]
        if not self._fit([rows[key] for key in changed]):
            self._refresh_lines([self._index[key] for key in changed], visible_only=True)

    def _fit(self, rows: Iterable[tuple[str, ...]]) -> bool:
        """Widen columns to fit `rows`; True (and everything repainted) when any grew."""
        grew = False
        for cells in rows:
            for i, c in enumerate(cells):
                if len(c) > self.widths[i]:
                    self.widths[i], grew = len(c), True
        if grew:
            self._strips.clear()
            self.header.update(layout(self.columns, self.widths))
            self.refresh()
        return grew

    def _refresh_lines(self, indexes: Sequence[int], *, visible_only: bool = False) -> None:
        """Repaint these rows' lines. `visible_only`: not those scrolled out of view, whose
        region would fall on the widgets below the table and repaint their lines instead."""
        top, (width, height) = self.scroll_offset.y, self.size
        regions = [
            Region(0, i - top, width, 1)
            for i in indexes
            if not visible_only or 0 <= i - top < height
        ]
        if regions:
            self.refresh(*regions)

    # --- drawing ------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        index = y + self.scroll_offset.y
        width = self._line_width()
        if index >= len(self.keys):
            return Strip.blank(width, self.rich_style)
        key = self.keys[index]
        cells = self.rows[key]
        look = (cells, index == self.cursor, index % 2 == 1, width)
        cached = self._strips.get(key)
        if cached is not None and cached[0] == look:
            return cached[1]
        style = self._styles()[0 if index == self.cursor else 1 if index % 2 else 2]
        text = layout(cells, self.widths)[:width].ljust(width)
        strip = Strip([Segment(text, style)], width)
        self._strips[key] = (look, strip)
        return strip

    def _styles(self) -> tuple[Style, Style, Style]:
        """(cursor, odd, even) line styles. Resolving a widget's style walks its CSS each
        time (a third of this widget's cost at 50 rows x 10 Hz): it changes only with the
        theme, focus or hover, which call notify_style_update."""
        if self._line_styles is None:
            base = self.rich_style
            self._line_styles = (
                base + self.get_component_rich_style("box-table--cursor"),
                base + self.get_component_rich_style("box-table--odd"),
                base,
            )
        return self._line_styles

    def notify_style_update(self) -> None:
        self._line_styles = None
        self._strips.clear()
        super().notify_style_update()

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(self._line_width(), len(self.keys))

    def _line_width(self) -> int:
        """What a line has beside the vertical scrollbar, when there is one: a line as wide
        as the widget made a horizontal scrollbar to reach the part under it."""
        return self.scrollable_content_region.width or self.size.width

    # --- the cursor ---------------------------------------------------------------

    def move_to(self, index: int) -> None:
        if not self.keys:
            return
        index = max(0, min(index, len(self.keys) - 1))
        if index == self.cursor:
            return
        old, self.cursor = self.cursor, index
        self._refresh_lines([old, index])
        self.scroll_to_region(Region(0, index, 1, 1), animate=False, immediate=True)
        self.post_message(self.RowHighlighted(self.cursor_key))

    def action_cursor(self, step: int) -> None:
        self.move_to(self.cursor + step)

    def action_page(self, direction: int) -> None:
        self.move_to(self.cursor + direction * max(1, self.size.height - 1))

    def action_jump(self, index: int) -> None:
        self.move_to(index if index >= 0 else len(self.keys) - 1)

    def action_select(self) -> None:
        if (key := self.cursor_key) is not None:
            self.post_message(self.RowSelected(key))

    def on_click(self, event: events.Click) -> None:
        index = event.y + self.scroll_offset.y
        if 0 <= index < len(self.keys):
            if index == self.cursor and event.chain >= 2:
                self.action_select()
            self.move_to(index)
