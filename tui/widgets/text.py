"""Pure formatting for the dashboard's cells."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from devbox.units import age, pct

__all__ = ["age", "pct", "release_hint", "size", "spark"]

_BLOCKS = " ▁▂▃▄▅▆▇█"


def spark(values: Sequence[float], width: int = 16, top: float = 100.0) -> str:
    """The last `width` values as block characters, scaled 0..top (missing left blank)."""
    tail = list(values)[-width:]
    scale = (len(_BLOCKS) - 1) / top
    last = len(_BLOCKS) - 1
    return "".join(_BLOCKS[min(last, max(0, int(v * scale + 0.5)))] for v in tail).rjust(width)


@functools.lru_cache(maxsize=4096)
def size(value: float | None) -> str:
    """Bytes as the dashboard shows them; cached: each row shows two (its GPUs' memory used
    and total) that stay the same for many samples, and formatting them was a fifth of a
    row's cost."""
    if value is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{value:.0f}{unit}" if unit in ("B", "K") else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def release_hint(release_at: float) -> str:
    """When a warned box goes, and the one key that keeps it (the screens bind K)."""
    clock = time.strftime("%H:%M:%S", time.localtime(release_at))
    return f"releases at {clock} unless used: K keeps it"
