"""Human units, in one place: sizes, rates, percentages, ages and plain-text tables, as
every view (the CLI's, the TUI's, `devbox explain`) prints them. Pure; imports nothing of
devbox, so the core and the pure policy can use it.

A value that was not reported prints as "-", never as 0.
"""

from __future__ import annotations

from collections.abc import Sequence

MISSING = "-"


def size(value: float | None) -> str:
    if value is None:
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def rate(value: float | None) -> str:
    return MISSING if value is None else f"{size(value)}/s"


def pct(value: float | None) -> str:
    return MISSING if value is None else f"{value:.0f}%"


def age(seconds: float | None) -> str:
    """A duration as its largest unit: 45s, 12m, 3h, 2d."""
    if seconds is None:
        return MISSING
    seconds = int(seconds)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds // span}{unit}"
    return f"{seconds}s"


_SPANS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: object) -> float | None:
    """A duration a person wrote, as seconds: a number, or "90s", "30m", "4h", "1d";
    None when it is not one. Not checked for finiteness: nan and inf come back as such."""
    if isinstance(value, bool):
        return None
    out: float | None = None
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str) and value[-1:] in _SPANS:
        try:
            out = float(value[:-1]) * _SPANS[value[-1]]
        except ValueError:
            return None
    return out


def num(value: float | None, unit: str, fmt: str = ".0f") -> str:
    return MISSING if value is None else f"{value:{fmt}}{unit}"


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
