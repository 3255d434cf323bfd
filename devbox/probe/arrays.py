"""On-demand replies (a histogram, a summary, a saved copy of a layer's tensor) for the
frameworks other than PyTorch: their tensors reach the link thread as numpy arrays, and
the answer is made there, off the training thread. The same reply bodies as
devbox.probe.replies, so `devbox probe` reads one format.

Imports numpy, which JAX and Keras both depend on: only their watchers import this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from devbox import protocol
from devbox.probe.link import Job
from devbox.protocol import ProbeRequest


def histogram(x: np.ndarray, bins: int) -> tuple[list[int], float, float]:
    """(counts over [low, high] of the finite values, low, high), as torch.histc bins
    them: `bins` equal bins over the data's own range."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        return [0] * bins, 0.0, 0.0
    low, high = float(finite.min()), float(finite.max())
    span = (low, high) if high > low else (low - 1.0, high + 1.0)  # histc widens by 1
    counts, _ = np.histogram(finite, bins=bins, range=span)
    return [int(c) for c in counts], low, high


def summary(x: np.ndarray) -> dict[str, Any]:
    f = np.asarray(x, dtype=np.float64)

    def number(value: float) -> float | None:
        return value if math.isfinite(value) else None

    if f.size == 0:
        values: dict[str, Any] = {"mean": None, "std": None, "min": None, "max": None}
    else:
        values = {
            "mean": number(float(f.mean())),
            "std": number(float(f.std())),
            "min": number(float(f.min())),
            "max": number(float(f.max())),
        }
    norm = float(np.sqrt(np.sum(f * f))) if f.size else 0.0
    values.update(norm=number(norm), nan=int(np.isnan(f).sum()), inf=int(np.isinf(f).sum()))
    return values


def answer(r: ProbeRequest, read: Callable[[], Any], step: int) -> Job:
    """The reply to `r`, where `read()` (run on the link thread) gives the layer's tensor
    at `step` as anything numpy converts (it waits for the device there)."""
    base: dict[str, Any] = {"id": r["id"], "pid": os.getpid(), "step": step}

    def job() -> list[bytes]:
        x = np.asarray(read())
        if r["kind"] == "histogram":
            counts, low, high = histogram(x, int(r.get("bins", 30)))
            body = {**base, "counts": counts, "low": low, "high": high}
        elif r["kind"] == "summary":
            body = {**base, "shape": list(x.shape), "dtype": str(x.dtype), **summary(x)}
        else:
            safe = r["layer"].replace("/", "_") or "model"
            name = f"{os.getpid()}-{step}-{safe}-{r['tensor']}.npy"
            path = Path.home() / ".devbox/probe" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, x)
            body = {**base, "path": str(path), "shape": list(x.shape)}
        return [protocol.encode(protocol.PROBE_REPLY, **body)]

    return job
