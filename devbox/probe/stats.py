"""The statistics, on the tensors' own device: each function returns a small tensor, never a
Python number, so the training thread never waits for the device. The probe's link thread
turns the stacked result into numbers (`rows`) once per report.

Imports torch: only devbox.probe.watcher imports this module, after torch was found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from devbox.protocol import LayerStats

# Columns of a report: activation statistics first (ACT of them), then parameter ones.
ACT_COLUMNS = ("act_mean", "act_std", "act_absmax", "act_zeros", "act_dead", "act_nan", "act_inf")
PARAM_COLUMNS = ("grad_norm", "grad_nan", "weight_norm", "update_ratio")
ACT = len(ACT_COLUMNS)
COLUMNS = ACT_COLUMNS + PARAM_COLUMNS
_COUNTS = {"act_nan", "act_inf", "grad_nan"}


def activation(out: torch.Tensor) -> torch.Tensor:
    """[mean, std, absmax, zero fraction, dead-unit fraction, NaN count, Inf count].

    A unit is one output feature: dim 1 of an image-like (4-D or 5-D) output, the last dim
    otherwise; it is dead when it is zero for every sample in the batch.

    This runs per layer on observed steps. On a GPU (and inside a torch.compile graph,
    whose compiler fuses it) it is device work only: `on_device`. On the CPU there is no
    device to wait for: every op has finished when it returns, so reading a value is free,
    and the costs are passes over the data and the ops themselves, where comparisons
    (x == 0, isnan, isinf: bool outputs) take 5 to 10 times as long as float ops (a
    128x512 output, one thread: 60 to 90 us against 5 to 10). `_on_cpu` therefore uses
    float ops only, and counts NaN/Inf only when the abs max says there are some."""
    x = out.detach()
    x = x.float() if x.dtype != torch.float32 else x
    if x.numel() == 0:  # no values: no statistics (and no reduction over an empty dim)
        return torch.cat([torch.full((5,), math.nan, device=x.device), x.new_zeros(2)])
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _on_cpu(x)
    return on_device(x)


def _unit_dims(x: torch.Tensor) -> tuple[int, ...]:
    """The dims a per-unit reduction reduces: all but the unit dim (see `activation`)."""
    unit = 1 if x.dim() in (4, 5) else x.dim() - 1
    return tuple(d for d in range(x.dim()) if d != unit)


def _on_cpu(x: torch.Tensor) -> torch.Tensor:
    """`activation` of a non-empty float32 CPU tensor, with float ops only (about 90 us
    for a 128x512 output where `on_device` takes 450); the arithmetic on the reduced
    values is done in Python, in double."""
    n = x.numel()
    a = x.abs()  # our own buffer: reused in place below
    peaks = a.amax(dim=_unit_dims(x)) if x.dim() >= 2 else None  # per-unit maxima of |x|
    absmax = (a if peaks is None else peaks).max().item()
    if not math.isfinite(absmax):  # NaN or Inf somewhere: count them, exactly
        return on_device(x)
    dead = math.nan if peaks is None else 1.0 - peaks.count_nonzero().item() / peaks.numel()
    # sign(|x|) is 1 for a non-zero value and 0 for a zero: their sum counts the non-zero
    # values (exact in float32 up to 2**24 of them, in float64 beyond).
    wide = torch.float64 if n >= 1 << 24 else None
    nonzero = a.sign_().sum(dtype=wide).item()
    mean = x.sum().item() / n
    # Two passes (the mean, then the squares around it): no cancellation when the mean is
    # far from zero, unlike E[x^2] - E[x]^2; torch.var_mean's Welford pass is slower here.
    d = torch.sub(x, mean, out=a)
    var = d.square_().sum().item() / n
    return torch.tensor([mean, math.sqrt(var), absmax, 1.0 - nonzero / n, dead, 0.0, 0.0])


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


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rows(names: Sequence[str], matrix: list[list[float]]) -> list[LayerStats]:
    """The report matrix (one row per layer, COLUMNS) as wire records: NaN/Inf become
    None, counts become ints."""
    out: list[LayerStats] = []
    for name, row in zip(names, matrix, strict=True):
        record: dict[str, object] = {"name": name}
        for column, value in zip(COLUMNS, row, strict=True):
            if column in _COUNTS:
                record[column] = int(value) if math.isfinite(value) else 0
            else:
                record[column] = _number(value)
        out.append(record)  # type: ignore[arg-type]
    return out
