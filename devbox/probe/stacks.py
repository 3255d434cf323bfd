"""Every thread's Python stack as text: what `devbox probe NAME --stacks` shows of a
process that seems hung. The probe's link thread makes it, so it comes while the training
thread is stuck (in a wait, a sleep or a loop); no torch here.
"""

from __future__ import annotations

import sys
import threading
import traceback

# The whole text; a frame is at most protocol.MAX_FRAME_BYTES, and a terminal full of one
# thread's frames says no more than its innermost ones.
MAX_BYTES = 64 * 1024
MAX_FRAMES = 60  # per thread, the innermost


def dump(*, answering: int | None = None) -> str:
    """Every thread: a header (name, ident, daemon) and its stack, innermost call last, as a
    traceback prints it. `answering`: the ident of the thread that asks, shown by name only
    (its stack is this function's)."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate() if t.ident is not None}
    main = threading.main_thread().ident
    # The main thread first (where training usually runs), then the others in start order.
    started = {ident: i for i, ident in enumerate(threads)}
    order = sorted(frames, key=lambda i: (i != main, started.get(i, len(started))))
    parts: list[str] = []
    for ident in order:
        thread = threads.get(ident)
        name = thread.name if thread is not None else "(not started by threading)"
        daemon = ", daemon" if thread is not None and thread.daemon else ""
        if ident == answering:
            parts.append(f"thread {name} (ident {ident}{daemon}): the probe, answering this\n")
            continue
        stack = "".join(traceback.format_stack(frames[ident], limit=MAX_FRAMES))
        parts.append(f"thread {name} (ident {ident}{daemon}):\n{stack}")
    return _bounded("\n".join(parts))


def _bounded(text: str) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_BYTES:
        return text
    cut = data[: MAX_BYTES - 100].decode("utf-8", "ignore")
    return f"{cut}\n... ({len(data) - len(cut.encode())} more bytes not shown)\n"
