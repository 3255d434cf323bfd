"""Alert policy: one report's per-layer statistics in, the alerts they raise out. Pure (no
torch, no I/O), so the thresholds are tested on their own and the agent could apply them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from devbox.protocol import LayerStats, ProbeAlert


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    # A layer's gradient norm above this is exploding; below `vanishing` (with weights that
    # are not all zero) it is vanishing. Defaults suit a model trained in float32 with a
    # loss of order one; watch(..., thresholds=...) changes them.
    exploding: float = 1e3
    vanishing: float = 1e-7
    # More than this fraction of a layer's output units were zero for a whole batch.
    dead: float = 0.9


def evaluate(layers: list[LayerStats], *, step: int, limits: Thresholds) -> list[ProbeAlert]:
    """The alerts of one report, at most one per (kind, layer), worst first."""
    alerts: list[ProbeAlert] = []

    def add(kind: str, layer: str, message: str) -> None:
        alerts.append({"kind": kind, "layer": layer, "step": step, "message": message})

    for s in layers:
        name = s["name"]
        if s["act_nan"] or s["grad_nan"]:
            where = "output" if s["act_nan"] else "gradient"
            count = f" ({s['act_nan']} values)" if s["act_nan"] else ""
            add("nan", name, f"NaN in the {where} of {name} at step {step}{count}")
        elif s["act_inf"]:
            add("inf", name, f"Inf in the output of {name} at step {step} ({s['act_inf']} values)")
        grad, weight = s["grad_norm"], s["weight_norm"]
        if grad is not None and math.isfinite(grad):
            if grad > limits.exploding:
                add("exploding", name, f"gradient norm of {name} is {grad:.3g} at step {step}")
            elif grad < limits.vanishing and (weight or 0.0) > 0.0:
                add("vanishing", name, f"gradient norm of {name} is {grad:.3g} at step {step}")
        dead = s["act_dead"]
        if dead is not None and dead > limits.dead:
            add("dead", name, f"{dead:.0%} of the units of {name} are dead at step {step}")
    return alerts


def nonfinite_output(*, step: int) -> ProbeAlert:
    """The per-step check (the sum of the model's output) found NaN or Inf: the next
    observed step says which layer."""
    return {
        "kind": "nan",
        "layer": "",
        "step": step,
        "message": f"NaN or Inf in the model's output at step {step}",
    }
