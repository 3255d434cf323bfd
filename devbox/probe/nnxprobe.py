"""The Flax NNX probe: statistics computed inside the researcher's compiled train step.

    watcher = probe.watch(model, every=50)

    @watcher.jit                      # instead of @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = watcher.value_and_grad(loss_fn)(model, x, y)   # nnx.value_and_grad
        optimizer.update(model, grads)
        return loss

NNX has no hooks, and a compiled step cannot call back into Python, so `watcher.jit`
compiles a few variants of the step and picks one per call from `plan()`:
- plain: exactly `nnx.jit(fn)`, for the steps nobody looks at;
- check: also the sum of the output (the loss), to tell NaN/Inf at once;
- observed: also the [layers x COLUMNS] report matrix, computed in the same program, and,
  for the requests of that step, the requested layers' whole tensors (one variant per
  requested set, at most MAX_VARIANTS kept).
Only the observed variants' tracing sees the probe: while it traces, the watched modules'
classes' `__call__` is wrapped (and restored after), so each watched layer's output goes
through jaxstats.activation; `value_and_grad` passes those statistics out of the gradient
transform as aux and keeps the model's gradients for the grad norms; the parameters are
read before and after `fn` (the optimizer's update) for the update ratio. The outputs are
jax arrays, read on the link thread: the training thread never waits for the device. A
check's sum is looked at on the training thread when the device has made it (at the next
step's start), so a NaN forces the next report at once (arrays.Unread).

Layer names are the modules' NNX paths joined with "/" ("blocks/0/linear"); by default
every leaf module that can be called (a module of no sub-modules); `layers=` takes names
or fnmatch patterns. A layer owns every parameter under its path.

Inside a transform NNX works on copies of the modules, so a layer is known there by its
path in the traced copy of the model (the argument of the model's class), not by identity.
"""

from __future__ import annotations

import collections
import fnmatch
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from devbox.probe import alerts as alert_policy
from devbox.probe import arrays, jaxstats
from devbox.probe.reporting import Plan, StepReporter

log = logging.getLogger("devbox.probe")

MAX_VARIANTS = 8  # observed variants kept compiled, one per set of requested tensors
Path = tuple[Any, ...]


def layer_name(path: Path) -> str:
    return "/".join(str(p) for p in path) or "model"


def _modules(model: Any) -> list[tuple[Path, Any]]:
    return [(tuple(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Module)]


def select(model: Any, layers: Sequence[str] | None) -> list[tuple[Path, Any]]:
    """The modules to watch, as (path, module): every callable leaf module, or those whose
    name matches one of `layers`."""
    named = [(p, m) for p, m in _modules(model) if p]
    if layers is None:
        parents = {p[:i] for p, _ in named for i in range(len(p))}
        chosen = [(p, m) for p, m in named if p not in parents and callable(m)]
        return chosen or [((), model)]
    chosen = [
        (p, m) for p, m in named if any(fnmatch.fnmatchcase(layer_name(p), x) for x in layers)
    ]
    if not chosen:
        known = ", ".join(layer_name(p) for p, _ in named[:20]) or "none"
        raise ValueError(f"devbox.probe: no layer matches {list(layers)} (layers: {known})")
    return chosen


def _params(model: Any) -> dict[Path, Any]:
    """The model's parameters by path (arrays, or tracers of them inside a trace)."""
    return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _flat(state: Any) -> dict[Path, Any]:
    out = {}
    for p, v in nnx.to_flat_state(state):
        out[tuple(p)] = v.get_value() if isinstance(v, nnx.Variable) else v
    return out


def _first_float(out: Any) -> Any:
    for leaf in jax.tree.leaves(out):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
    return None


@dataclass
class _Trace:
    """What one trace of an observed variant (or of a gradient inside it) gathers."""

    index: dict[int, int]  # id() of a module of the traced copy -> its layer
    keep: frozenset[int]  # layers whose whole output a request wants
    model: Any = None  # the traced copy of the watched model
    acts: dict[int, Any] = field(default_factory=dict)
    kept: dict[int, Any] = field(default_factory=dict)
    grads: dict[Path, Any] | None = None


class NnxWatcher(StepReporter):
    def __init__(
        self,
        model: Any,
        *,
        every: int,
        layers: Sequence[str] | None,
        thresholds: alert_policy.Thresholds,
        find_socket: Callable[[], str | None] | None = None,
    ) -> None:
        self.model = model
        self.modules = select(model, layers)
        self._paths = [p for p, _ in self.modules]
        names = [layer_name(p) for p in self._paths]
        super().__init__(
            names, every=every, thresholds=thresholds, framework="jax", find_socket=find_socket
        )
        self._index = {n: i for i, n in enumerate(self.names)}
        self._classes = {type(m) for _, m in self.modules}
        params = list(_params(model))
        # The parameter paths each layer owns: every one under the layer's path.
        self._owned = [[q for q in params if q[: len(p)] == p] for p in self._paths]
        self._traces: list[_Trace] = []
        self.unread = arrays.Unread(self)  # the checked steps' output sums
        self._broken = False
        self._closed = False
        self.start()

    # --- the researcher's API ---------------------------------------------------------

    def jit(self, fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
        """`nnx.jit` for the train step (keyword arguments go to nnx.jit): one call is one
        training step."""
        if fn is None:
            return lambda f: StepFunction(self, f, jit_kwargs)
        return StepFunction(self, fn, jit_kwargs)

    def value_and_grad(
        self, f: Callable[..., Any], *, argnums: Any = 0, has_aux: bool = False, **kwargs: Any
    ) -> Callable[..., Any]:
        """`nnx.value_and_grad`; on observed steps it also carries the layers' statistics
        out of the gradient's trace and keeps the model's gradients for the report."""

        def call(*args: Any, **kw: Any) -> Any:
            outer = self._traces[-1] if self._traces else None
            if outer is None:
                grad = nnx.value_and_grad(f, argnums=argnums, has_aux=has_aux, **kwargs)
                return grad(*args, **kw)
            return self._observed_grad(outer, f, argnums, has_aux, kwargs, args, kw)

        return call

    def close(self) -> None:
        """The step runs as plain nnx.jit from now on; the link closes."""
        self._closed = True
        self.unread.flush()  # the last steps' checks still count: a NaN there is alerted
        super().close()

    # --- inside the observed trace ----------------------------------------------------

    def _observed_grad(
        self,
        outer: _Trace,
        f: Callable[..., Any],
        argnums: Any,
        has_aux: bool,
        kwargs: dict[str, Any],
        args: tuple[Any, ...],
        kw: dict[str, Any],
    ) -> Any:
        # Values made inside the gradient's trace may not leave it but as its outputs:
        # the statistics travel as aux, without gradient.
        def inner(*a: Any, **k: Any) -> Any:
            with self._tracing(a, k, outer.keep) as trace:
                result = f(*a, **k)
            loss, aux = result if has_aux else (result, None)
            ours = jax.lax.stop_gradient((trace.acts, trace.kept))
            return loss, (aux, ours)

        grad = nnx.value_and_grad(inner, argnums=argnums, has_aux=True, **kwargs)
        (loss, (aux, (acts, kept))), grads = grad(*args, **kw)
        for i, a in acts.items():
            outer.acts.setdefault(i, a)
        for i, a in kept.items():
            outer.kept.setdefault(i, a)
        if isinstance(argnums, int) and argnums < len(args) and args[argnums] is outer.model:
            outer.grads = _flat(grads)
        return ((loss, aux) if has_aux else loss), grads

    @contextmanager
    def _tracing(self, args: Any, kwargs: Any, keep: frozenset[int]) -> Iterator[_Trace]:
        model = self._find_model(args, kwargs)
        index: dict[int, int] = {}
        if model is not None:
            where = {p: i for i, p in enumerate(self._paths)}
            for p, m in _modules(model):
                if p in where:
                    index[id(m)] = where[p]
        trace = _Trace(index=index, keep=keep, model=model)
        self._traces.append(trace)
        try:
            with self._wrapped_calls():
                yield trace
        finally:
            self._traces.pop()

    def _find_model(self, args: Any, kwargs: Any) -> Any:
        for a in [*args, *kwargs.values()]:
            if isinstance(a, type(self.model)):
                return a
        return None

    @contextmanager
    def _wrapped_calls(self) -> Iterator[None]:
        saved = {cls: cls.__dict__.get("__call__") for cls in self._classes}
        for cls in self._classes:
            cls.__call__ = self._recording(cls.__call__)
        try:
            yield
        finally:
            for cls, own in saved.items():
                if own is None:
                    del cls.__call__  # it was inherited
                else:
                    cls.__call__ = own

    def _recording(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = call(module, *args, **kwargs)
            trace = self._traces[-1] if self._traces else None
            layer = trace.index.get(id(module)) if trace is not None else None
            if trace is not None and layer is not None and layer not in trace.acts:
                x = _first_float(out)
                if x is not None:
                    trace.acts[layer] = jaxstats.activation(x)
                    if layer in trace.keep:
                        trace.kept[layer] = x
            return out

        return recorded

    def _groups(self, params: dict[Path, Any]) -> list[list[Any]]:
        return [[params[q] for q in owned if q in params] for owned in self._owned]

    def observed_step(
        self, fn: Callable[..., Any], wanted: frozenset[tuple[str, str]]
    ) -> Callable[..., Any]:
        """The observed variant of `fn`, to be compiled: (output, report matrix, the
        wanted tensors by (tensor, layer))."""
        keep = frozenset(self._index[layer] for tensor, layer in wanted if tensor == "activation")

        def step(*args: Any, **kwargs: Any) -> Any:
            with self._tracing(args, kwargs, keep) as trace:
                before = _params(trace.model) if trace.model is not None else {}
                out = fn(*args, **kwargs)
            after = _params(trace.model) if trace.model is not None else {}
            acts = [trace.acts.get(i) for i in range(len(self.names))]
            grads = None if trace.grads is None else self._groups(trace.grads)
            matrix = jaxstats.report(acts, grads, self._groups(before), self._groups(after))
            tensors = {}
            for tensor, layer in wanted:
                i = self._index[layer]
                if tensor == "activation":
                    if i in trace.kept:
                        tensors[(tensor, layer)] = trace.kept[i]
                    continue
                source = before if tensor == "weight" else (trace.grads or {})
                parts = [jnp.ravel(source[q]) for q in self._owned[i] if q in source]
                if parts:
                    tensors[(tensor, layer)] = jnp.concatenate(parts)
            return out, matrix, tensors

        return step

    # --- after a step -------------------------------------------------------------------

    def reported(self, step: int, matrix: Any, tensors: dict[tuple[str, str], Any]) -> None:
        self.submit_report(step, lambda: np.asarray(matrix).tolist())
        for r in list(self.active):
            key = (r["tensor"], r["layer"])
            if key in tensors:
                self.answered(r)
                self.submit(arrays.answer(r, tensors[key], step))
            elif r["tensor"] != "activation":
                self.answered(r)
                self.reply_error(r, f"layer {r['layer']} has no {r['tensor']} now")

    def broke(self) -> None:
        """The probe's own failure: said once, and the probe is off; training goes on."""
        if not self._broken:
            self._broken = True
            log.exception("devbox.probe failed and is now off; training goes on")

    @property
    def off(self) -> bool:
        return self._broken or self._closed


class StepFunction:
    """What `watcher.jit(fn)` returns: call it as the nnx.jit'ed fn."""

    def __init__(self, watcher: NnxWatcher, fn: Callable[..., Any], kwargs: dict[str, Any]):
        self.watcher, self.fn, self.kwargs = watcher, fn, kwargs
        self.plain = nnx.jit(fn, **kwargs)
        self._check: Any = None
        self._observed: collections.OrderedDict[frozenset[tuple[str, str]], Any] = (
            collections.OrderedDict()
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        w = self.watcher
        if w.off:
            return self.plain(*args, **kwargs)
        try:
            w.unread.read()  # a NaN the device has shown by now forces this step's report
            plan = w.plan()
            step = w.step
            compiled = self._variant(plan)
        except Exception:
            w.broke()
            return self.plain(*args, **kwargs)
        if compiled is None:
            out = self.plain(*args, **kwargs)
            self._ended(observed=False)
            return out
        try:
            result = compiled(*args, **kwargs)
        except Exception:
            # Off, then the step once more as the researcher wrote it: an error of theirs
            # shows there, as without the probe.
            w.broke()
            return self.plain(*args, **kwargs)
        try:
            if plan.observe:
                out, matrix, tensors = result
                w.reported(step, matrix, tensors)
            else:
                out, total = result
                w.unread.add(step, total)
            self._ended(observed=plan.observe)
        except Exception:
            w.broke()
            return result[0]
        return out

    def _variant(self, plan: Plan) -> Any:
        if plan.observe:
            wanted = frozenset((r["tensor"], r["layer"]) for r in plan.requests)
            if wanted not in self._observed:
                if len(self._observed) >= MAX_VARIANTS:
                    self._observed.popitem(last=False)
                step = self.watcher.observed_step(self.fn, wanted)
                self._observed[wanted] = nnx.jit(step, **self.kwargs)
            self._observed.move_to_end(wanted)
            return self._observed[wanted]
        if plan.check:
            if self._check is None:
                fn = self.fn

                def checked(*args: Any, **kwargs: Any) -> Any:
                    out = fn(*args, **kwargs)
                    return out, jaxstats.finite_total(jax.tree.leaves(out))

                self._check = nnx.jit(checked, **self.kwargs)
            return self._check
        return None

    def _ended(self, *, observed: bool) -> None:
        self.watcher.step_ended(observed=observed)
        if observed:
            self.watcher.expire()


def watch_nnx(
    model: Any,
    *,
    every: int,
    layers: Sequence[str] | None,
    thresholds: alert_policy.Thresholds,
    find_socket: Callable[[], str | None] | None = None,
) -> NnxWatcher:
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"devbox.probe.watch: {type(model).__name__} is a Flax model but not a Flax NNX "
            "module (flax.nnx.Module): Linen modules are not supported"
        )
    return NnxWatcher(
        model, every=every, layers=layers, thresholds=thresholds, find_socket=find_socket
    )
