"""The statistics of devbox.probe.stats in keras.ops, so that one definition runs on every
Keras backend and inside the compiled train step (jax.jit traces it with the step; on torch
it runs eagerly). Each function returns backend tensors, never Python numbers: nothing here
waits for the device; the probe's link thread reads the result once per report.

Imports keras: only devbox.probe.kerasprobe imports this module, after keras was found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from keras import ops

# The backend's float32 dtype object (a torch.dtype, a numpy dtype for jax), compared as is.
_FLOAT32 = ops.convert_to_tensor(0.0, "float32").dtype


def unit_axis(layer: Any, ndim: int) -> int:
    """The axis whose entries are a layer's units (devbox.probe.stats): the channel axis, 1
    for a channels_first convolution's output, the last one otherwise."""
    if ndim >= 3 and getattr(layer, "data_format", None) == "channels_first":
        return 1
    return ndim - 1


def _f32(x: Any) -> Any:
    # Every keras.ops call costs a dispatch (tens of us on eager torch): skip a no-op cast.
    return x if x.dtype == _FLOAT32 else ops.cast(x, "float32")


def activation(out: Any, axis: int) -> Any:
    """[mean, std, absmax, zero fraction, dead-unit fraction, NaN count, Inf count] of a
    layer's output, in float32; a unit (along `axis`) is dead when it is zero for every
    sample; a 1-D output has no units (NaN)."""
    x = _f32(ops.stop_gradient(out))
    if math.prod(x.shape) == 0:  # static shapes under a trace: no reduction over nothing
        return ops.convert_to_tensor([math.nan] * 5 + [0.0, 0.0], "float32")
    a = ops.abs(x)
    if x.ndim >= 2:
        others = tuple(d for d in range(x.ndim) if d != axis)
        peaks = ops.max(a, axis=others)  # per unit; NaN where the unit holds a NaN
        dead = ops.mean(ops.cast(ops.equal(peaks, 0.0), "float32"))
    else:
        dead = ops.convert_to_tensor(math.nan, "float32")
    mean = ops.mean(x)
    std = ops.sqrt(ops.mean(ops.square(x - mean)))  # two passes: no cancellation
    zeros = ops.mean(ops.cast(ops.equal(x, 0.0), "float32"))
    nan = ops.sum(ops.cast(ops.isnan(x), "float32"))
    inf = ops.sum(ops.cast(ops.isinf(x), "float32"))
    return ops.stack([mean, std, ops.max(a), zeros, dead, nan, inf])


def squares(tensors: Sequence[Any]) -> list[Any]:
    """The sum of squares of each tensor, in float32."""
    return [ops.sum(ops.square(_f32(ops.stop_gradient(t)))) for t in tensors]


def norm_and_bad(sums: Sequence[Any]) -> tuple[Any, Any]:
    """(L2 norm over several tensors, count of them with a NaN/Inf) from their `squares`:
    NaN for none (a layer without parameters)."""
    if not sums:
        return ops.convert_to_tensor(math.nan, "float32"), ops.convert_to_tensor(0.0, "float32")
    stacked = ops.stack(sums)  # a few ops per layer, not per tensor
    bad = ops.sum(ops.cast(ops.logical_not(ops.isfinite(stacked)), "float32"))
    return ops.sqrt(ops.sum(stacked)), bad


def flat(tensors: Sequence[Any]) -> Any:
    """The tensors flattened and joined, for a request on a layer's parameters."""
    return ops.concatenate([ops.reshape(ops.stop_gradient(t), (-1,)) for t in tensors])


def missing_activation() -> Any:
    """The activation row of a layer that did not run in the step."""
    return ops.convert_to_tensor([math.nan] * 7, "float32")
