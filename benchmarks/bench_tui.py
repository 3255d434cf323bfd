"""What the dashboard costs, and how fast it answers a key.

`devbox tui` runs headless on --boxes x --gpus synthetic boxes streaming at --rate Hz
(tests/tui/synthetic.py, the same feed the snapshot tests use). Measured, each in its own
process so that one's CPU never lands on the other's bill:

- the TUI's CPU (user + system, % of one core) while it streams and redraws, nobody typing;
- key-press-to-screen latency: "j"/"k" alternately every --key-every seconds while the
  stream goes on, from just before the key is handed to the app (from a thread, as a real
  terminal's input thread does) to the first frame that repaints the line of the row the
  cursor moved to (see `_TuiProbe` for how "on screen" is detected); the CPU of that phase too;
- the floor: a Rich Live table of the same rows and columns, fed the same samples through the
  same store, refreshed at the TUI's redraw rate to a null terminal.

Headless Textual builds each frame's strips but skips turning them into terminal bytes (the
headless check in `App._display`), so the TUI child does that encoding itself,
`CompositorUpdate.render_segments`, as a terminal run would; only the write is missing, and
the floor's writes go to a sink as well. Both use a truecolor console.

Targets (issue "Step 4: the full-screen TUI"): p99 key latency under 50 ms; CPU at most 15% of
one core. The JSON reports them next to the numbers; nothing here asserts on time.

    python benchmarks/bench_tui.py [--boxes 50] [--gpus 8] [--rate 10] [--seconds 20]
    python benchmarks/bench_tui.py --profile 25   # adds the TUI's top functions by own time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file (python benchmarks/bench_x.py, from any folder), Python puts benchmarks/
    # first on the path: the repo's root takes its place, as under `python -m`, for the
    # benchmarks.* and tests.* imports (neither is an installed package).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import REPO, emit, summary

REDRAW_HZ = 10.0  # the app's default redraw clock; the floor refreshes at the same rate
SIZE = (160, 60)
TARGETS = {"key_latency_p99_ms_max": 50, "cpu_pct_max": 15}


def _ms(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    s = summary(samples)
    return {
        "p50": round(s["median"] * 1000, 3),
        "p99": round(s["p99"] * 1000, 3),
        "max": round(max(samples) * 1000, 3),
        "min": round(s["min"] * 1000, 3),
        "n": s["n"],
    }


class _Cpu:
    """Process CPU (all threads) over wall time, as % of one core."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def pct(self) -> float:
        wall = time.perf_counter() - self.wall0
        return round(100 * (time.process_time() - self.cpu0) / wall, 3)


class _Profile:
    """cProfile around the measured phases when asked; a no-op otherwise."""

    def __init__(self, top: int) -> None:
        import cProfile

        self.top = top
        self.prof = cProfile.Profile() if top else None

    def __enter__(self) -> None:
        if self.prof:
            self.prof.enable()

    def __exit__(self, *exc: object) -> None:
        if self.prof:
            self.prof.disable()

    def report(self) -> list[str]:
        if not self.prof:
            return []
        import pstats

        stats = pstats.Stats(self.prof)
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        lines = []
        for (path, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows[: self.top]:
            where = path.split("site-packages/")[-1].replace(str(REPO) + "/", "")
            lines.append(
                f"{tottime:8.3f}s own {cumtime:8.3f}s cum {ncalls:9d} calls  {where}:{line}({func})"
            )
        return lines


# --- the TUI, headless ---------------------------------------------------------------


class _TuiProbe:
    """Frames out of the app, and the key presses waiting for theirs.

    "On screen" is the first frame, after the key's handler moved the table's cursor, whose
    update covers the screen line of the row the cursor moved to. The app's
    `_display(screen, update)` is where a terminal run turns the compositor's update into
    bytes and writes them; this probe wraps it on the instance, does the same encoding (which
    headless mode skips), and reads from the update which lines it repaints (a LayoutUpdate's
    region, or a ChopsUpdate's spans). Any repaint of that line after the cursor moved shows
    the cursor there, because the table renders its lines from its current state. A
    `call_after_refresh` callback would be a looser end point: it can run after a frame that
    was already under way and lacks the key's effect.
    """

    def __init__(self, app: Any) -> None:
        from textual._compositor import ChopsUpdate, CompositorUpdate, LayoutUpdate

        self._types = (CompositorUpdate, LayoutUpdate, ChopsUpdate)
        self.app = app
        self.frames = 0
        self.bytes = 0
        self.table: Any = None
        # One key in flight at a time; written by the key thread, read on the loop.
        self.sent_at: float | None = None
        self.handled_at: float | None = None
        self.row: int | None = None
        self.done = threading.Event()
        self.handled: list[float] = []
        self.on_screen: list[float] = []
        self.missed = 0
        original = app._display

        def display(screen: Any, update: Any) -> None:
            original(screen, update)
            if isinstance(update, self._types[0]):
                self.bytes += len(update.render_segments(app.console))
                self.frames += 1
                self._check(update)

        app._display = display

    def watch(self, table: Any) -> None:
        self.table = table
        move_to = table.move_to

        def moved(index: int) -> None:
            move_to(index)
            if self.sent_at is not None and self.handled_at is None:
                self.handled_at = time.perf_counter()
                self.row = table.cursor

        table.move_to = moved

    def _check(self, update: Any) -> None:
        if self.handled_at is None or self.row is None or self.sent_at is None:
            return
        table = self.table
        region = table.content_region
        y = region.y + self.row - int(table.scroll_offset.y)
        _, layout, chops = self._types
        if isinstance(update, layout):
            covered = update.region.y <= y < update.region.bottom
        elif isinstance(update, chops):
            covered = any(
                sy == y and x1 < region.right and x2 > region.x for sy, x1, x2 in update.spans
            )
        else:
            covered = False
        if covered:
            now = time.perf_counter()
            self.handled.append(self.handled_at - self.sent_at)
            self.on_screen.append(now - self.sent_at)
            self.sent_at = None
            self.done.set()

    def press(self, key: str, timeout: float = 2.0) -> None:
        """From the key thread: hand one key to the app and wait for its frame."""
        from textual import events

        self.done.clear()
        self.handled_at = None
        self.row = None
        event = events.Key(key, key)
        event.set_sender(self.app)
        self.sent_at = time.perf_counter()
        self.app._driver.send_message(event)
        if not self.done.wait(timeout):
            self.sent_at = None
            self.missed += 1


def _keys(probe: _TuiProbe, seconds: float, every: float, stop: threading.Event) -> None:
    deadline = time.perf_counter() + seconds
    key = "j"
    while time.perf_counter() < deadline and not stop.is_set():
        start = time.perf_counter()
        probe.press(key)
        key = "k" if key == "j" else "j"
        stop.wait(max(0.0, every - (time.perf_counter() - start)))


async def _tui(args: argparse.Namespace) -> dict[str, Any]:
    from tests.tui.synthetic import SyntheticFeed
    from tui.app import make_app
    from tui.widgets.boxtable import BoxTable

    app = make_app(feed=SyntheticFeed(args.boxes, args.gpus), rate=args.rate, redraw_hz=REDRAW_HZ)
    probe = _TuiProbe(app)
    profile = _Profile(args.profile)
    async with app.run_test(size=SIZE):
        # Settle: every box listed and streaming, the first full-table draws done.
        deadline = time.monotonic() + 30
        while len(app.store.views) < args.boxes or any(
            v.sample is None for v in app.store.views.values()
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the synthetic boxes never all streamed")
            await asyncio.sleep(0.05)
        table = app.screen.query_one("#boxes", BoxTable)
        table.move_to(0)
        probe.watch(table)
        await asyncio.sleep(args.settle)

        with profile:
            frames0, bytes0, cpu = probe.frames, probe.bytes, _Cpu()
            t0 = time.perf_counter()
            await asyncio.sleep(args.seconds)
            idle_wall = time.perf_counter() - t0
            idle_cpu, idle_frames = cpu.pct(), probe.frames - frames0
            idle_bytes = probe.bytes - bytes0

            stop = threading.Event()
            cpu = _Cpu()
            keys = threading.Thread(
                target=_keys, args=(probe, args.seconds, args.key_every, stop), daemon=True
            )
            keys.start()
            try:
                while keys.is_alive():
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
            keys_cpu = cpu.pct()
    return {
        "cpu_pct_of_one_core": idle_cpu,
        "key_latency_ms": {**_ms(probe.on_screen), "missed": probe.missed},
        "key_handled_ms": _ms(probe.handled),
        "cpu_pct_of_one_core_with_keys": keys_cpu,
        "key_every_s": args.key_every,
        "frames_per_s": round(idle_frames / idle_wall, 2),
        "terminal_kib_per_s": round(idle_bytes / idle_wall / 1024, 1),
        **({"profile_tottime": profile.report(), "profiled": True} if args.profile else {}),
    }


# --- the floor: a Rich Live table of the same data ------------------------------------


class _Sink:
    """A terminal that keeps nothing: counts what it is given."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: str) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


async def _floor(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from tests.tui.synthetic import SyntheticFeed
    from tui.feed import Store
    from tui.screens.boxes import COLUMNS, row

    # The same store and the same row formatting as the app, so that the difference
    # between the two is the UI toolkit, not the data path.
    feed = SyntheticFeed(args.boxes, args.gpus)
    store = Store()
    store.set_boxes(await feed.boxes())

    async def follow(box: Any) -> None:
        async for frame in feed.stream(box, rate=args.rate):
            store.frame(box.name, frame)

    tasks = [asyncio.create_task(follow(b)) for b in feed.box_list]
    sink = _Sink()
    console = Console(
        file=sink,  # type: ignore[arg-type]
        force_terminal=True,
        color_system="truecolor",
        width=SIZE[0],
        height=SIZE[1],
        legacy_windows=False,
    )

    def table() -> Table:
        now = time.time()
        t = Table(*COLUMNS, title=f"{len(store.views)} boxes", expand=True)
        for name in sorted(store.views):
            t.add_row(*row(store.views[name], now))
        return t

    frames = 0
    profile = _Profile(args.profile)
    with Live(table(), console=console, auto_refresh=False) as live:

        async def refresh(seconds: float) -> None:
            nonlocal frames
            end = time.perf_counter() + seconds
            tick = 1.0 / REDRAW_HZ
            next_at = time.perf_counter()
            while time.perf_counter() < end:
                live.update(table(), refresh=True)
                frames += 1
                next_at += tick
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

        await refresh(args.settle)
        with profile:
            frames0, bytes0, cpu = frames, sink.bytes, _Cpu()
            t0 = time.perf_counter()
            await refresh(args.seconds)
            wall = time.perf_counter() - t0
            pct = cpu.pct()
    for task in tasks:
        task.cancel()
    return {
        "cpu_pct_of_one_core": pct,
        "frames_per_s": round((frames - frames0) / wall, 2),
        "terminal_kib_per_s": round((sink.bytes - bytes0) / wall / 1024, 1),
        **({"profile_tottime": profile.report(), "profiled": True} if args.profile else {}),
    }


# --- the parent -------------------------------------------------------------------------


def _child(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "TEXTUAL_COLOR_SYSTEM": "truecolor", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="devbox-bench-tui-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, __file__, "--child", kind, "--out", str(out)]
        for flag in ("boxes", "gpus", "rate", "seconds", "settle", "key_every", "profile"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=3 * args.seconds + args.settle + 120,
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"the {kind} child failed:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rate", type=float, default=10.0, help="samples per second per box")
    parser.add_argument("--seconds", type=float, default=20.0, help="per measured phase")
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--key-every", type=float, default=0.2)
    parser.add_argument("--profile", type=int, default=0, help="top N functions (cProfile)")
    parser.add_argument("--child", choices=("tui", "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = asyncio.run(_tui(args) if args.child == "tui" else _floor(args))
        Path(args.out).write_text(json.dumps(result))
        return

    tui = _child("tui", args)
    floor = _child("floor", args)
    floor_cpu = floor["cpu_pct_of_one_core"]
    emit(
        {
            "benchmark": "tui",
            "boxes": args.boxes,
            "gpus": args.gpus,
            "rate_hz": args.rate,
            "redraw_hz": REDRAW_HZ,
            "seconds": args.seconds,
            "size": list(SIZE),
            "tui": tui,
            "rich_live_floor": floor,
            "tui_over_floor": round(tui["cpu_pct_of_one_core"] / floor_cpu, 2)
            if floor_cpu > 0
            else None,
            "targets": TARGETS,
        }
    )


if __name__ == "__main__":
    main()
