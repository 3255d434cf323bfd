"""On-demand replies (a histogram, a summary, a saved copy) for the probes whose tensors
reach the host as numpy arrays: JAX (and Flax NNX) and Keras 3 on any backend. The same
reply frames as the torch probe's (devbox.probe.replies), so `devbox probe` shows one view.

`answer` is called on the training thread with the framework's array (a jax.Array, a
torch tensor under Keras, ...): it keeps a reference only (jax arrays are immutable; the
Keras probe hands over a copy), and the link thread converts it to numpy (which waits for
the device there, never on the training thread) and does the arithmetic.

Imports numpy, which every one of those frameworks depends on.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from devbox import protocol
from devbox.probe.link import Job
from devbox.probe.reporting import StepReporter
from devbox.protocol import ProbeRequest

UNREAD = 4  # checked outputs left to the device before the link thread waits for them


def to_numpy(x: Any) -> Any:
    """A host float copy of `x` (a jax.Array, a numpy array, a torch tensor)."""
    if hasattr(x, "detach"):  # torch, under Keras's torch backend
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def ready(x: Any) -> bool:
    """Whether reading `x` waits for nothing: a JAX array the device has made, a CPU
    tensor, a number."""
    if hasattr(x, "is_ready"):
        return bool(x.is_ready())
    device = getattr(x, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def finite(x: Any) -> bool:
    return bool(np.isfinite(to_numpy(x)).all())


class Unread:
    """The checked outputs (a step's loss, or its output's sum) the device has not made
    yet, read on the training thread once made: a NaN forces the next step's report at
    once. Left to the link thread, the force would come many steps late: a JAX training
    loop dispatches ahead and keeps the GIL for several fast steps before that thread
    runs. One not made within UNREAD steps goes to the link thread, which waits for it
    there; the training thread never waits for the device."""

    def __init__(self, reporter: StepReporter) -> None:
        self.reporter = reporter
        self.items: list[tuple[int, Any]] = []

    def add(self, step: int, x: Any) -> None:
        self.items.append((step, x))

    def read(self) -> None:
        """At a step's boundary, before the next step's plan."""
        r, unread = self.reporter, []
        for step, x in self.items:
            if ready(x):
                if not finite(x):
                    r.force = True
                    r.submit_check(step, lambda: math.nan)
            else:
                unread.append((step, x))
        while len(unread) > UNREAD:
            step, x = unread.pop(0)
            r.submit_check(step, _host(x))
        self.items = unread

    def flush(self, copy: Any = None) -> None:
        """Every one to the link thread (`copy` makes a host copy first, here)."""
        for step, x in self.items:
            self.reporter.submit_check(step, _host(copy(x) if copy else x))
        self.items = []


def _host(x: Any) -> Any:
    return lambda: to_numpy(x)


def histogram(x: Any, bins: int) -> tuple[list[int], float, float]:
    """(counts over [low, high] of the finite values, low, high); zeros over [0, 0] when
    no value is finite."""
    flat = to_numpy(x).astype(np.float64, copy=False).reshape(-1)
    finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        return [0] * bins, 0.0, 0.0
    low, high = float(finite.min()), float(finite.max())
    counts, _ = np.histogram(finite, bins=bins, range=(low, high) if high > low else None)
    return [int(c) for c in counts], low, high


def summary(x: Any) -> dict[str, Any]:
    """mean, std, min, max, L2 norm (None where not finite), NaN and Inf counts."""
    a = to_numpy(x)
    f = a.astype(np.float64, copy=False).reshape(-1)
    empty = f.size == 0
    values = {
        "mean": math.nan if empty else float(f.mean()),
        "std": math.nan if empty else float(f.std()),
        "min": math.nan if empty else float(f.min()),
        "max": math.nan if empty else float(f.max()),
        "norm": float(np.sqrt(np.dot(f, f))),
    }
    out: dict[str, Any] = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
    out.update(nan=int(np.isnan(f).sum()), inf=int(np.isinf(f).sum()))
    out.update(shape=list(a.shape), dtype=str(a.dtype))
    return out


def answer(r: ProbeRequest, x: Any, step: int) -> Job:
    """The reply job for request `r` on `x` (the layer's tensor at `step`)."""
    base: dict[str, Any] = {"id": r["id"], "pid": os.getpid(), "step": step}
    if r["kind"] == "histogram":
        bins = int(r.get("bins", 30))

        def histogram_reply() -> list[bytes]:
            counts, low, high = histogram(x, bins)
            body = {**base, "counts": counts, "low": low, "high": high}
            return [protocol.encode(protocol.PROBE_REPLY, **body)]

        return histogram_reply
    if r["kind"] == "summary":
        return lambda: [protocol.encode(protocol.PROBE_REPLY, **base, **summary(x))]
    safe = r["layer"].replace("/", "_") or "model"
    path = Path.home() / ".devbox/probe" / f"{os.getpid()}-{step}-{safe}-{r['tensor']}.npy"

    def save() -> list[bytes]:
        a = to_numpy(x)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, a)
        body = {**base, "path": str(path), "shape": list(a.shape)}
        return [protocol.encode(protocol.PROBE_REPLY, **body)]

    return save
