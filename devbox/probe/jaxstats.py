"""The statistics in jax.numpy, for the NNX probe: pure functions of arrays, traced into
the researcher's compiled train step on observed steps, so they cost device work only and
the training thread never waits for a value (the link thread reads the result).

Definitions as in devbox.probe.stats (the torch probe's), with one difference: a unit is
always the last dim, since Flax convolutions are channels-last.

Imports jax: only devbox.probe.nnxprobe imports this module, after flax was found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from devbox.probe.reporting import ACT, COLUMNS

Array = Any  # a jax.Array or a tracer of one (jax is untyped here)
Group = Sequence[Array]  # the parameters (or gradients) of one layer


def activation(x: Array) -> Array:
    """[mean, std, absmax, zero fraction, dead-unit fraction, NaN count, Inf count] of a
    layer's output, as a float32 array of ACT. A unit is dead when it is zero for every
    sample (every position of every other dim); a 1-D output has no units: NaN."""
    x = jnp.asarray(x).astype(jnp.float32)
    if x.size == 0:  # no values: no statistics (a max over nothing is an error)
        return jnp.array([math.nan] * 5 + [0.0, 0.0], jnp.float32)
    a = jnp.abs(x)
    if x.ndim >= 2:
        peaks = a.reshape(-1, x.shape[-1]).max(axis=0)  # per-unit maxima of |x|
        dead = (peaks == 0).mean()
    else:
        dead = jnp.float32(math.nan)
    values = [
        x.mean(),
        x.std(),  # over all values, no correction (as torch's std(unbiased=False))
        a.max(),
        (x == 0).mean(),
        dead,
        jnp.isnan(x).sum(),
        jnp.isinf(x).sum(),
    ]
    return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


def _squares(x: Array) -> Array:
    return jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32)))


def norms(groups: Sequence[Group]) -> tuple[Array, Array]:
    """(L2 norm of each group's arrays together, count of its arrays with NaN/Inf): NaN
    and 0 for an empty group (a layer without parameters)."""
    norm, bad = [], []
    for group in groups:
        squares = [_squares(x) for x in group]
        norm.append(jnp.sqrt(sum(squares)) if squares else jnp.float32(math.nan))
        bad.append(sum((~jnp.isfinite(s)).astype(jnp.float32) for s in squares) if squares else 0.0)
    return _vector(norm), _vector(bad)


def update_ratio(before: Sequence[Group], after: Sequence[Group]) -> Array:
    """||w_after - w_before|| / ||w_before|| per group: the optimizer step's size against
    the weights, exact (inside a compiled step the "before" arrays are the step's own
    inputs, kept alive, not copies). NaN for an empty group."""
    ratios = []
    for old, new in zip(before, after, strict=True):
        if not old:
            ratios.append(jnp.float32(math.nan))
            continue
        moved = sum(
            _squares(jnp.asarray(n) - jnp.asarray(o)) for o, n in zip(old, new, strict=True)
        )
        ratios.append(jnp.sqrt(moved) / jnp.sqrt(sum(_squares(o) for o in old)))
    return _vector(ratios)


def report(
    acts: Sequence[Array | None],
    grads: Sequence[Group] | None,
    before: Sequence[Group],
    after: Sequence[Group],
) -> Array:
    """The [layers x COLUMNS] report matrix. `acts[i]` is layer i's `activation` (None:
    the layer did not run: NaN), `grads` the gradients per layer (None: the step took
    none through the watcher: NaN), `before`/`after` the parameters around the step."""
    layers = len(before)
    missing = jnp.array([math.nan] * ACT, jnp.float32)
    act = jnp.stack([missing if a is None else a for a in acts]) if layers else None
    if grads is None:
        grad_norm = jnp.full((layers,), math.nan, jnp.float32)
        grad_bad = jnp.zeros((layers,), jnp.float32)
    else:
        grad_norm, grad_bad = norms(grads)
    weight_norm, _ = norms(before)
    ratio = update_ratio(before, after)
    if act is None:
        return jnp.zeros((0, len(COLUMNS)), jnp.float32)
    params = jnp.stack([grad_norm, grad_bad, weight_norm, ratio], axis=1)
    return jnp.concatenate([act, params], axis=1)


def finite_total(leaves: Sequence[Array]) -> Array:
    """The sum of every floating value in `leaves` (a step's output or loss), float32:
    NaN or Inf exactly when some value is (or when it overflows, which also deserves a
    look)."""
    total = jnp.float32(0.0)
    for x in leaves:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            total = total + jnp.sum(x.astype(jnp.float32))
    return total


def _vector(values: Sequence[Any]) -> Array:
    return jnp.stack([jnp.asarray(v, jnp.float32) for v in values]) if values else jnp.zeros(0)
