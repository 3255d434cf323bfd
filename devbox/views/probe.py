"""`devbox probe` as text: a model's per-layer statistics, alerts, histograms and tensor
summaries rendered for a terminal. Pure: no I/O. A value not reported prints as "-"."""

from __future__ import annotations

import time
from typing import Any

from devbox.protocol import LayerStats, ProbeAlert, ProbeReply, ProbeStats
from devbox.units import MISSING, table

BAR = 40


def num(value: float | None) -> str:
    if value is None:
        return MISSING
    if value == 0:
        return "0"
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


def process_label(process: dict[str, Any]) -> str:
    """A probed process as the views name it: the framework its probe hooks ("torch",
    "keras/jax", "jax"), then its command line (the framework first: a long command is cut)."""
    cmd, framework = str(process.get("cmd", "")), str(process.get("framework", ""))
    return f"[{framework}] {cmd}" if framework else cmd


def frac(value: float | None) -> str:
    return MISSING if value is None else f"{value:.0%}"


def _bad(s: LayerStats) -> str:
    parts = [f"{s['act_nan']} nan"] if s["act_nan"] else []
    parts += [f"{s['act_inf']} inf"] if s["act_inf"] else []
    parts += [f"grad {s['grad_nan']}"] if s["grad_nan"] else []
    return ", ".join(parts) or "0"


def layer_cells(s: LayerStats) -> list[str]:
    """A layer's statistics as text cells, in HEAD's order after the name."""
    return [
        num(s["act_mean"]),
        num(s["act_std"]),
        num(s["act_absmax"]),
        frac(s["act_zeros"]),
        frac(s["act_dead"]),
        _bad(s),
        num(s["grad_norm"]),
        num(s["weight_norm"]),
        num(s["update_ratio"]),
    ]


HEAD = ["MEAN", "STD", "ABSMAX", "ZEROS", "DEAD", "NAN/INF", "GRAD NORM", "WEIGHT", "UPDATE/W"]


def layer_rows(layers: list[LayerStats]) -> list[list[str]]:
    return [["LAYER", *HEAD]] + [[s["name"], *layer_cells(s)] for s in layers]


def alert_lines(alerts: list[ProbeAlert]) -> list[str]:
    return [f"ALERT {a['kind']}: {a['message']}" for a in alerts]


def render(box: str, stats: ProbeStats, *, cmd: str = "") -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(stats["t"]))
    what = f"  {cmd}" if cmd else ""
    lines = [f"box {box}  pid {stats['pid']}  step {stats['step']} at {clock}{what}", ""]
    if stats["layers"]:
        lines += table(layer_rows(stats["layers"]), right=tuple(range(1, 10)))
    lines += alert_lines(stats["alerts"])
    return "\n".join(lines) + "\n"


def render_reply(reply: ProbeReply, *, request: dict[str, Any]) -> str:
    what = f"{request['tensor']} of {request['layer']} at step {reply['step']}"
    if "counts" in reply:
        counts = reply["counts"]
        low, high = reply.get("low", 0.0), reply.get("high", 0.0)
        width = (high - low) / len(counts) if counts else 0.0
        top = max(counts) if counts else 0
        lines = [f"histogram of the {what} (pid {reply['pid']})"]
        for i, count in enumerate(counts):
            bar = "#" * (round(BAR * count / top) if top else 0)
            lines.append(
                f"{num(low + i * width):>10} .. {num(low + (i + 1) * width):<10} {count:>9}  {bar}"
            )
        return "\n".join(lines) + "\n"
    if "path" in reply:
        return f"saved the {what} to {reply['path']} in the box (shape {reply.get('shape')})\n"
    fields = [
        ("shape", str(reply.get("shape"))),
        ("dtype", str(reply.get("dtype"))),
        *((k, num(_float(reply, k))) for k in ("mean", "std", "min", "max", "norm")),
        ("nan", str(reply.get("nan", 0))),
        ("inf", str(reply.get("inf", 0))),
    ]
    return f"summary of the {what}\n" + "\n".join(f"  {k:<6} {v}" for k, v in fields) + "\n"


def _float(reply: ProbeReply, key: str) -> float | None:
    value = reply.get(key)
    return float(value) if isinstance(value, int | float) else None
