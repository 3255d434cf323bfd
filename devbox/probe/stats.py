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

    Written for few, cheap kernels (this runs per layer on observed steps): the variance
    comes from sums of the values shifted by one of them (one pass each, and no
    cancellation when the mean is far from zero, unlike E[x^2] - E[x]^2 unshifted), where
    torch.std_mean is a slower Welford pass on CPUs; absmax and dead units both come from
    the per-unit maxima of |x|."""
    x = out.detach()
    x = x.float() if x.dtype != torch.float32 else x
    n = max(1, x.numel())
    if x.dim() >= 2:
        units = x.transpose(1, -1) if x.dim() in (4, 5) else x
        # |x| reduced over every dim but the unit one: per-unit maxima.
        peaks = units.abs().flatten(0, -2).amax(0)
        dead = peaks.eq(0).float().mean()
    else:
        peaks = x.abs().reshape(-1)
        dead = torch.full((), math.nan, device=x.device)
    flat = x.reshape(-1)
    d = flat - flat[0] if flat.numel() else flat
    shift_mean = d.sum() / n
    mean = shift_mean + (flat[0] if flat.numel() else 0.0)
    var = (d * d).sum() / n - shift_mean * shift_mean
    std = var.clamp(min=0.0).sqrt()
    absmax = peaks.amax() if peaks.numel() else torch.zeros((), device=x.device)
    zeros = flat.eq(0).sum() / n
    nan = flat.ne(flat).sum()  # NaN is the one value unequal to itself
    inf = torch.isinf(flat).sum()
    return torch.stack([mean, std, absmax, zeros, dead, nan.float(), inf.float()])


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
