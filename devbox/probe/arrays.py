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
from devbox.protocol import ProbeRequest


def to_numpy(x: Any) -> Any:
    """A host float copy of `x` (a jax.Array, a numpy array, a torch tensor)."""
    if hasattr(x, "detach"):  # torch, under Keras's torch backend
        x = x.detach().cpu().numpy()
    return np.asarray(x)


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
