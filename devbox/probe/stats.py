"""The statistics, on the tensors' own device: each function returns a small tensor, never a
Python number, so the training thread never waits for the device. The probe's link thread
turns the stacked result into numbers (`rows`) once per report.

Imports torch: only devbox.probe.watcher imports this module, after torch was found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import torch


class Scratch:
    """A reusable CPU buffer for `activation`'s temporary: a fresh one per layer (256 KB
    for a 128x512 output) comes from the kernel as new pages each time, and those page
    faults cost more than the statistics (50 us against 10 for the pass that fills it)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}  # by size: a model has a few

    def flat(self, n: int) -> torch.Tensor:
        buffer = self._buffers.get(n)
        if buffer is None:
            if len(self._buffers) >= 8:  # many sizes: keep the memory bounded
                self._buffers.clear()
            buffer = self._buffers[n] = torch.empty(n)
        return buffer


Row: TypeAlias = "torch.Tensor | list[float]"  # a tensor on a device, numbers on the CPU


def activation(out: torch.Tensor, scratch: Scratch | None = None) -> Row:
    """[mean, std, absmax, zero fraction, dead-unit fraction, NaN count, Inf count]: a
    tensor on the output's device, or a list of numbers, computed on the CPU.

    A unit is one output feature: dim 1 of an image-like (4-D or 5-D) output, the last dim
    otherwise; it is dead when it is zero for every sample in the batch.

    This runs per layer on observed steps. On a GPU (and inside a torch.compile graph,
    whose compiler fuses it) it is device work only: `on_device`. On the CPU there is no
    device to wait for: every op has finished when it returns, so reading a value is free,
    and the costs are passes over the data and the ops themselves, where comparisons
    (x == 0, isnan, isinf: bool outputs) take 5 to 10 times as long as float ops (a
    128x512 output, one thread: 60 to 90 us against 5 to 10). `_on_cpu` therefore uses
    float ops only, counts NaN/Inf only when the abs max says there are some, and gives
    numbers (a 7-element tensor per layer would cost more than some of its statistics)."""
    x = out.detach()
    x = x.float() if x.dtype != torch.float32 else x
    if x.numel() == 0:  # no values: no statistics (and no reduction over an empty dim)
        return torch.cat([torch.full((5,), math.nan, device=x.device), x.new_zeros(2)])
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _on_cpu(x, scratch or Scratch())
    return on_device(x)


def _unit_dims(x: torch.Tensor) -> tuple[int, ...]:
    """The dims a per-unit reduction reduces: all but the unit dim (see `activation`)."""
    unit = 1 if x.dim() in (4, 5) else x.dim() - 1
    return tuple(d for d in range(x.dim()) if d != unit)


def _on_cpu(x: torch.Tensor, scratch: Scratch) -> Row:
    """`activation` of a non-empty float32 CPU tensor, with float ops only and each value
    read once (`.item()`): about 130 us for a fresh 128x512 layer output where `on_device`
    takes 450 (benchmarks/bench_probe.py). The arithmetic on the reduced values is done in
    Python, in double."""
    n = x.numel()
    flat = x.reshape(-1)
    a = torch.abs(flat, out=scratch.flat(n))  # reused in place below
    # Per-unit maxima of |x| (a unit is dead when its maximum is 0); 1-D: no units.
    peaks = a.view(x.shape).amax(dim=_unit_dims(x)) if x.dim() >= 2 else a
    # Each value read right after its pass, while the data is in cache; sum and squares
    # first, while the fresh output is.
    total = flat.sum().item()
    squares = torch.dot(flat, flat).item()
    absmax = peaks.max().item()
    if not math.isfinite(absmax):  # NaN or Inf somewhere: count them, exactly
        return on_device(x)
    dead = math.nan if x.dim() < 2 else 1.0 - peaks.count_nonzero().item() / peaks.numel()
    # sign(|x|) is 1 for a non-zero value and 0 for a zero: their sum counts the non-zero
    # values (exact in float32 up to 2**24 of them, in float64 beyond).
    nonzero = (a.sign_().sum(dtype=torch.float64) if n >= 1 << 24 else a.sign_().sum()).item()
    mean = total / n
    # E[x^2] - E[x]^2 from one pass (a BLAS dot, no temporary), where the mean is not
    # large against the spread (mean^2 <= 4 var), as for nearly every activation. Beyond
    # that the difference cancels: two passes instead, the squares around the mean.
    var = squares / n - mean * mean
    if 4 * var < mean * mean:
        d = torch.sub(flat, mean, out=a)
        var = torch.dot(d, d).item() / n
    return [mean, math.sqrt(max(var, 0.0)), absmax, 1.0 - nonzero / n, dead, 0.0, 0.0]


def on_device(x: torch.Tensor) -> torch.Tensor:
    """`activation` of a non-empty float32 tensor without reading any value back to the
    host: a handful of reductions queued on the tensor's device."""
    if x.dim() >= 2:
        peaks = x.abs().amax(dim=_unit_dims(x))  # per-unit maxima of |x|
        dead = peaks.eq(0).float().mean()
    else:
        peaks = x.abs()
        dead = torch.full((), math.nan, device=x.device)
    var, mean = torch.var_mean(x, correction=0)  # one Welford pass on a GPU
    absmax = peaks.amax()
    zeros = x.eq(0).sum() / x.numel()
    nan = x.isnan().sum()
    inf = x.isinf().sum()
    return torch.stack([mean, var.sqrt(), absmax, zeros, dead, nan.float(), inf.float()])


def per_layer_norms(
    tensors: Sequence[torch.Tensor], owner: torch.Tensor, layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm per layer, count of tensors with NaN/Inf per layer) of `tensors`, where
    tensors[i] belongs to layer owner[i]: one fused norm kernel, then a segment sum."""
    device = owner.device
    if not tensors:
        zero = torch.zeros(layers, device=device)
        return zero, zero
    norms = torch.stack(torch._foreach_norm(list(tensors))).float()
    bad = (~torch.isfinite(norms)).float()
    squares = torch.zeros(layers, device=device).index_add_(0, owner, norms * norms)
    return squares.sqrt(), torch.zeros(layers, device=device).index_add_(0, owner, bad)


# The update/weight ratio compares a parameter before and after the optimizer step. A
# full copy of every parameter costs three passes over the model on each observed step
# (copy, subtract, norm: 5 ms a step for a 6 MB model on one CPU core, a third of the
# step). A fixed random sample of SAMPLE entries per tensor estimates |w_after - w_before|
# instead: its sum of squares, scaled by numel / SAMPLE, is unbiased, and with 4096
# entries the ratio is within a few percent (tests/probe/test_probe_unit.py), which is
# far finer than the orders of magnitude the ratio is read in. Smaller tensors are
# compared whole, so their ratio is exact; the denominator is always the exact norm.
SAMPLE = 4096


def sample_indices(numel: int, device: torch.device) -> torch.Tensor | None:
    """Which entries of a flattened tensor of `numel` entries the update ratio compares:
    None (all of them) up to SAMPLE, else SAMPLE fixed random ones, sorted (a gather in
    memory order), the same on every step."""
    if numel <= SAMPLE:
        return None
    generator = torch.Generator().manual_seed(numel)
    picked = torch.randperm(numel, generator=generator)[:SAMPLE].sort().values
    return picked.to(device)


def pick(t: torch.Tensor, index: torch.Tensor | None, *, copy: bool) -> torch.Tensor:
    """The sampled entries of `t`, flat (a copy where `copy`, or where sampled)."""
    flat = t.detach().reshape(-1)
    if index is None:
        return flat.clone() if copy else flat
    return flat.index_select(0, index)


def histogram(x: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(counts over [low, high] of the finite values, [low, high], non-finite count)."""
    flat = x.detach().float().flatten()
    finite = flat[torch.isfinite(flat)]  # data-dependent size: only on request
    if finite.numel() == 0:
        return torch.zeros(bins), torch.zeros(2), int(flat.numel())
    low, high = torch.aminmax(finite)
    counts = torch.histc(finite, bins=bins, min=0, max=0)  # 0, 0: the data's own range
    return counts, torch.stack([low, high]), int(flat.numel() - finite.numel())


def summary(x: torch.Tensor) -> torch.Tensor:
    """[mean, std, min, max, L2 norm, NaN count, Inf count] of a whole tensor."""
    f = x.detach().float()
    std, mean = torch.std_mean(f, correction=0) if f.numel() > 0 else (f.sum(), f.sum())
    if f.numel() == 0:
        low = high = torch.full((), math.nan, device=f.device)
    else:
        low, high = torch.aminmax(f)
    norm = torch.linalg.vector_norm(f)
    return torch.stack(
        [mean, std, low, high, norm, torch.isnan(f).sum().float(), torch.isinf(f).sum().float()]
    )
