"""On-demand requests (a histogram, a summary, a saved copy of a layer's tensor): checking
them, and the replies. The tensor work is queued on the device by the training thread; the
returned job (run on the link thread) reads the result and makes the reply frame.

Imports torch: only devbox.probe.watcher imports this module, after torch was found.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from devbox import protocol
from devbox.probe import stats
from devbox.probe.link import Job
from devbox.probe.reporting import Host
from devbox.protocol import ProbeRequest


def to_host(t: torch.Tensor) -> Host:
    """Start copying `t` to the host; the returned callable (run on the link thread) waits
    for the copy and gives Python numbers. The training thread never waits."""
    if t.device.type == "cuda":
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def read() -> Any:
            done.synchronize()
            return pinned.tolist()

        return read
    copy = t.detach()
    return lambda: copy.tolist()


def answer(r: ProbeRequest, x: torch.Tensor, step: int) -> Job:
    """Start the request's device work on `x` (the layer's tensor at `step`)."""
    base: dict[str, Any] = {"id": r["id"], "pid": os.getpid(), "step": step}
    if r["kind"] == "histogram":
        counts, bounds, _ = stats.histogram(x, int(r.get("bins", 30)))
        counts_h, bounds_h = to_host(counts), to_host(bounds)

        def histogram() -> list[bytes]:
            low, high = bounds_h()
            body = {**base, "counts": [int(c) for c in counts_h()], "low": low, "high": high}
            return [protocol.encode(protocol.PROBE_REPLY, **body)]

        return histogram
    if r["kind"] == "summary":
        values = to_host(stats.summary(x))
        shape, dtype = list(x.shape), str(x.dtype).removeprefix("torch.")

        def summary() -> list[bytes]:
            mean, std, low, high, norm, nan, inf = values()
            numbers = {
                k: (v if math.isfinite(v) else None)
                for k, v in (("mean", mean), ("std", std), ("min", low), ("max", high))
            }
            body = {**base, "shape": shape, "dtype": dtype, **numbers}
            body.update(norm=norm if math.isfinite(norm) else None, nan=int(nan), inf=int(inf))
            return [protocol.encode(protocol.PROBE_REPLY, **body)]

        return summary
    copy = x.detach().clone()
    safe = r["layer"].replace("/", "_") or "model"
    path = Path.home() / ".devbox/probe" / f"{os.getpid()}-{step}-{safe}-{r['tensor']}.pt"

    def save() -> list[bytes]:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(copy.cpu(), path)
        body = {**base, "path": str(path), "shape": list(copy.shape)}
        return [protocol.encode(protocol.PROBE_REPLY, **body)]

    return save
