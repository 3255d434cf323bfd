"""The Keras 3 watcher: a callback that observes `model.fit` on the JAX and PyTorch backends.

    model.fit(x, y, callbacks=[probe.watch(model)])

Keras compiles its own train step, so there is nothing to hook inside it. Instead, at each
batch's start the watcher asks the shared StepReporter what the step does, and points
`model.train_function` at the matching function:
- nothing: Keras's own function, untouched (an unobserved step costs a plan() and an
  attribute check);
- a finiteness check: Keras's own function, whose logs (the loss) the watcher keeps;
- observed: the watcher's own train step, which does what Keras's trainer does (loss and
  gradients as the backend's trainer takes them, the optimizer's update, loss and metric
  tracking) and also returns the [layers x COLUMNS] matrix, computed inside the step
  (jax.jit traces it, once per set of requested tensors). Activations come from wrapping
  the watched layers' `call` while the step runs (on JAX: while it is traced), so the
  forward pass is the step's own, not a second one.
Keras may run steps ahead of its callbacks, so a step's end (report, heartbeat, a save
before release) is dealt with at the next batch's start or at the end of training, where
the previous step's results exist as (possibly not yet computed) device arrays that the
link thread reads.

The watcher is both the callback and the StepReporter (one object): `probe.watch(model)`
returns what goes into `callbacks=[...]`, and it has the same `close()`, `step` and `link`
as the torch watcher. Its callback methods never use `Callback.model`, which on JAX syncs
Keras's whole state back into the variables at every access.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from devbox.probe import alerts as alert_policy
from devbox.probe import arrays, kerasstats, release
from devbox.probe.reporting import Plan, StepReporter

log = logging.getLogger("devbox.probe")

# What an observed step hands back besides Keras's own results: the report matrix and the
# tensors the step's requests want, by (tensor kind, layer index).
Wants = tuple[tuple[str, int], ...]


def named_layers(model: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every layer of `model`, nested models' own layers too ("inner/dense"), without the
    input layers (they compute nothing)."""
    for layer in getattr(model, "layers", []):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        name = prefix + layer.name
        yield name, layer
        if isinstance(layer, keras.Model):
            yield from named_layers(layer, name + "/")


def select(model: Any, layers: Sequence[str] | None) -> list[tuple[str, Any]]:
    """The layers to watch: every leaf layer, or those whose name matches a pattern."""
    named = list(named_layers(model))
    if layers is None:
        chosen = [(n, layer) for n, layer in named if not isinstance(layer, keras.Model)]
    else:
        chosen = [
            (n, layer) for n, layer in named if any(fnmatch.fnmatchcase(n, p) for p in layers)
        ]
    if not chosen:
        known = ", ".join(n for n, _ in named[:20]) or "none"
        raise ValueError(f"devbox.probe: no layer matches {list(layers or [])} (layers: {known})")
    return chosen


def watch_keras(
    model: Any,
    *,
    every: int,
    layers: Sequence[str] | None,
    thresholds: alert_policy.Thresholds,
    find_socket: Callable[[], str | None] | None = None,
) -> KerasWatcher:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"devbox.probe.watch needs a keras.Model (a Keras layer is not one), "
            f"not {type(model).__name__}"
        )
    return KerasWatcher(
        model, every=every, layers=layers, thresholds=thresholds, find_socket=find_socket
    )


class _Captured:
    """What the wrapped layers' calls saw in one step: a statistics row per layer index,
    and the outputs that requests want whole."""

    def __init__(self, keep: set[int]) -> None:
        self.keep = keep
        self.rows: dict[int, Any] = {}
        self.kept: dict[int, Any] = {}


class KerasWatcher(keras.callbacks.Callback, StepReporter):
    def __init__(
        self,
        model: Any,
        *,
        every: int,
        layers: Sequence[str] | None,
        thresholds: alert_policy.Thresholds,
        find_socket: Callable[[], str | None] | None = None,
    ) -> None:
        keras.callbacks.Callback.__init__(self)
        self.net = model  # not `self.model`: Callback's property syncs JAX state on access
        self.watched = select(model, layers)
        self.keras_backend = keras.backend.backend()
        StepReporter.__init__(
            self,
            [n for n, _ in self.watched],
            every=every,
            thresholds=thresholds,
            framework=f"keras/{self.keras_backend}",
            find_socket=find_socket,
        )
        observers: dict[str, Callable[..., Any]] = {
            "jax": self._observed_jax,
            "torch": self._observed_torch,
        }
        self._observe = observers.get(self.keras_backend)
        if self._observe is None:
            log.warning(
                "devbox.probe: Keras on %s: per-layer statistics are for the jax and torch "
                "backends; this one gets the finiteness check only",
                self.keras_backend,
            )
        self._normal: Any = None  # Keras's own train function, taken at on_train_begin
        self._checking: Any = None
        self._compiled: dict[Wants, Any] = {}  # the observed JAX step, per request set
        self._plan = Plan(False, False, ())
        self._in_step = False
        self._outputs: tuple[Any, dict[tuple[str, int], Any]] | None = None
        self._loss: Any = None
        self._unread = arrays.Unread(self)  # checked losses the device has not made yet
        self._broken = False
        self.start()

    # --- Keras's callback methods -----------------------------------------------------

    def on_train_begin(self, logs: Any = None) -> None:
        self._guarded(self._train_begins)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._guarded(self._batch_begins)

    def on_train_end(self, logs: Any = None) -> None:
        self._guarded(self._last_step)
        self._restore()

    def _guarded(self, fn: Callable[[], None]) -> None:
        """The probe never raises into training: its first failure switches it off."""
        if self._broken:
            return
        try:
            fn()
        except Exception:
            self._switch_off()

    def _switch_off(self) -> None:
        self._broken, self._in_step = True, False
        log.exception("devbox.probe failed and is now off; training goes on")
        self._restore()

    def _train_begins(self) -> None:
        current = self.net.train_function
        ours = current is self._normal or getattr(current, "_devbox_probe", False)
        if current is not None and not ours:
            self._normal = current
            self._checking = self._make_checking(current)
            self._compiled.clear()  # a new compile: maybe a new optimizer or loss
        self._in_step = False

    def _batch_begins(self) -> None:
        self._end_step()  # the previous step's, now that Keras started the next one
        self._plan = plan = self.plan()
        self._outputs, self._loss = None, None
        if plan.observe and self._observe is not None:
            fn = self._make_observed(plan)
        elif plan.observe or plan.check:
            fn = self._checking
            self._refuse(plan)
        else:
            fn = self._normal
        if self.net.train_function is not fn:
            self.net.train_function = fn
        self._in_step = True

    def _refuse(self, plan: Plan) -> None:
        """Requests on a backend without the observed step: answered, not kept for ever."""
        for r in plan.requests:
            self.answered(r)
            self.reply_error(
                r, f"keras/{self.keras_backend}: requests need the jax or torch backend"
            )

    def _restore(self) -> None:
        current = getattr(self.net, "train_function", None)
        if self._normal is not None and getattr(current, "_devbox_probe", False):
            self.net.train_function = self._normal

    # --- a step's end -----------------------------------------------------------------

    def _last_step(self) -> None:
        """The end of the last step: its device arrays are read here, since training is
        over (nothing waits), so that the link thread is not left converting JAX arrays
        while a script that ends with fit shuts the interpreter down."""
        if self._outputs is not None:
            matrix, tensors = self._outputs
            self._outputs = (to_host(matrix), {k: to_host(v) for k, v in tensors.items()})
        if self._loss is not None:
            self._loss = to_host(self._loss)
        self._end_step()
        self._unread.flush(to_host)

    def _end_step(self) -> None:
        if not self._in_step:
            return
        self._in_step = False
        step, observed = self.step, self._outputs is not None
        if self._outputs is not None:
            matrix, tensors = self._outputs
            self._outputs = None
            self.submit_report(step, lambda: arrays.to_numpy(matrix))
            self._answer(step, tensors)
        elif self._loss is not None:
            self._unread.add(step, self._loss)
            self._loss = None
        self._unread.read()
        if release.pending is not None and hasattr(self.net, "jax_state_sync"):
            # A save runs in step_ended: on JAX the weights are in Keras's state, not yet
            # in the variables the save function reads.
            self.net.jax_state_sync()
        self.step_ended(observed=observed)

    def _answer(self, step: int, tensors: dict[tuple[str, int], Any]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        for r in list(self.active):
            x = tensors.get((r["tensor"], index[r["layer"]]))
            if x is not None:
                self.answered(r)
                self.submit(arrays.answer(r, x, step))
            elif r["tensor"] != "activation":
                self.answered(r)
                self.reply_error(r, f"layer {r['layer']} has no {r['tensor']}")
        self.expire()

    # --- the train functions ----------------------------------------------------------

    def _make_checking(self, normal: Any) -> Any:
        """Keras's own function, keeping the loss it logs (finite or not)."""
        jax = self.keras_backend == "jax"

        def checking(*args: Any) -> Any:
            out = normal(*args)
            self._loss = _loss_of(out[0] if jax else out)
            return out

        checking._devbox_probe = True  # type: ignore[attr-defined]
        return checking

    def _make_observed(self, plan: Plan) -> Any:
        index = {n: i for i, n in enumerate(self.names)}
        wants: Wants = tuple(sorted({(r["tensor"], index[r["layer"]]) for r in plan.requests}))
        observe, normal = self._observe, self._normal
        assert observe is not None

        def observed(*args: Any) -> Any:
            if self._broken:
                return normal(*args)
            return observe(wants, *args)

        observed._devbox_probe = True  # type: ignore[attr-defined]
        return observed

    def _observed_jax(self, wants: Wants, state: Any, iterator: Any) -> Any:
        data = next(iterator)
        try:
            logs, state, self._outputs = self._jax_step(wants)(state, data)
        except Exception:
            self._switch_off()
            return self._normal(state, itertools.chain([data], iterator))
        rest = self.net.steps_per_execution - 1
        if rest > 0:  # the execution's other batches, by Keras's own step
            with contextlib.suppress(StopIteration):  # the data ended within the execution
                logs, state = self._normal(state, itertools.islice(iterator, rest))
        return logs, state

    def _jax_step(self, wants: Wants) -> Any:
        fn = self._compiled.get(wants)
        if fn is None:
            import jax

            net = self.net

            def step(state: Any, data: Any) -> Any:
                return self._jax_train_step(wants, state, data)

            jit = not net.run_eagerly and net.jit_compile
            fn = self._compiled[wants] = jax.jit(step, donate_argnums=0) if jit else step
        return fn

    def _jax_train_step(self, wants: Wants, state: Any, data: Any) -> Any:
        """Keras's JAX train step (keras/src/backend/jax/trainer.py), plus the statistics."""
        import jax

        net = self.net
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        keep = {i for kind, i in wants if kind == "activation"}

        def loss_fn(trainable: Any, non_trainable: Any, metrics_vars: Any) -> Any:
            with self._capture(keep) as seen:
                loss, aux = net.compute_loss_and_updates(
                    trainable,
                    non_trainable,
                    metrics_vars,
                    x,
                    y,
                    sample_weight,
                    training=True,
                    optimizer_variables=optimizer_vars,
                )
            return loss, (aux, seen.rows, seen.kept)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (aux, rows, kept)), grads = grad_fn(trainable, non_trainable, metrics_vars)
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        new_trainable, optimizer_vars = net.optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
        logs, metrics_vars = net._update_metrics_variables(
            metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
        )
        outputs = self._results(wants, rows, kept, grads, trainable, new_trainable)
        outputs = jax.lax.stop_gradient(outputs)
        return logs, (new_trainable, non_trainable, optimizer_vars, metrics_vars), outputs

    def _observed_torch(self, wants: Wants, data: Any) -> Any:
        try:
            return self._torch_train_step(wants, data[0])
        except Exception:
            # The step may have half run (gradients, the update): Keras's own step is
            # not re-run on this batch, so that no batch is applied twice.
            self._switch_off()
            self._outputs = None
            return {}

    def _torch_train_step(self, wants: Wants, data: Any) -> Any:
        """Keras's torch train step (keras/src/backend/torch/trainer.py), plus the
        statistics."""
        import torch

        net = self.net
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        keep = {i for kind, i in wants if kind == "activation"}
        with self._capture(keep) as seen:
            y_pred = net(x, training=True) if net._call_has_training_arg else net(x)
        net.zero_grad()
        loss = net._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        batch = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
        net._loss_tracker.update_state(loss, sample_weight=batch)
        if net.optimizer is not None:
            loss = net.optimizer.scale_loss(loss)
        weights = net.trainable_weights[:]
        grads: list[Any] = []
        before: list[Any] = []
        after: list[Any] = []
        if weights:
            loss.backward()
            grads = [v.value.grad for v in weights]
            owned = {j for idx in self._owners() for j in idx}
            with torch.no_grad():
                before = [
                    v.value.detach().clone() if j in owned else None for j, v in enumerate(weights)
                ]
                net.optimizer.apply(grads, weights)
                after = [v.value.detach() for v in weights]
        with torch.no_grad():
            self._outputs = self._results(wants, seen.rows, seen.kept, grads, before, after)
        return net.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # --- the statistics, inside the step ----------------------------------------------

    @contextlib.contextmanager
    def _capture(self, keep: set[int]) -> Iterator[_Captured]:
        """Wrap the watched layers' `call` for the step (an instance attribute over the
        class's method), recording each one's output statistics."""
        seen = _Captured(keep)
        saved: list[tuple[Any, Any]] = []
        try:
            for i, (_, layer) in enumerate(self.watched):
                saved.append((layer, layer.__dict__.get("call")))
                object.__setattr__(layer, "call", _recording(layer, i, layer.call, seen))
            yield seen
        finally:
            for layer, previous in saved:
                if previous is None:
                    object.__delattr__(layer, "call")
                else:
                    object.__setattr__(layer, "call", previous)

    def _owners(self) -> list[list[int]]:
        """For each watched layer, the positions of its trainable variables in the model's
        (the order of Keras's trainable state and gradients)."""
        position = {id(v): j for j, v in enumerate(self.net.trainable_variables)}
        return [
            [position[id(v)] for v in layer.trainable_variables if id(v) in position]
            for _, layer in self.watched
        ]

    def _results(
        self,
        wants: Wants,
        rows: dict[int, Any],
        kept: dict[int, Any],
        grads: Sequence[Any],
        before: Sequence[Any],
        after: Sequence[Any],
    ) -> tuple[Any, dict[tuple[str, int], Any]]:
        """The report matrix, and the tensors the requests want. `before`/`after`: the
        trainable variables around the optimizer's update (None: not watched)."""
        ops = keras.ops
        owners = self._owners()
        owned = sorted({j for idx in owners for j in idx})
        has_grad = {j for j in owned if j < len(grads) and grads[j] is not None}
        grad_sq = dict(
            zip(
                sorted(has_grad),
                kerasstats.squares([grads[j] for j in sorted(has_grad)]),
                strict=True,
            )
        )
        weight_sq = dict(zip(owned, kerasstats.squares([before[j] for j in owned]), strict=True))
        moved = [ops.subtract(after[j], before[j]) for j in owned]
        moved_sq = dict(zip(owned, kerasstats.squares(moved), strict=True))
        matrix = []
        for i, idx in enumerate(owners):
            act = rows.get(i)
            act = kerasstats.missing_activation() if act is None else act
            grad_norm, grad_bad = kerasstats.norm_and_bad(
                [grad_sq[j] for j in idx if j in has_grad]
            )
            weight_norm, _ = kerasstats.norm_and_bad([weight_sq[j] for j in idx])
            moved_norm, _ = kerasstats.norm_and_bad([moved_sq[j] for j in idx])
            params = ops.stack([grad_norm, grad_bad, weight_norm, moved_norm / weight_norm])
            matrix.append(ops.concatenate([act, params]))
        tensors: dict[tuple[str, int], Any] = {}
        for kind, i in wants:
            if kind == "activation" and i in kept:
                tensors[kind, i] = kept[i]
            elif kind == "gradient" and any(j in has_grad for j in owners[i]):
                tensors[kind, i] = kerasstats.flat([grads[j] for j in owners[i] if j in has_grad])
            elif kind == "weight" and owners[i]:
                tensors[kind, i] = kerasstats.flat([before[j] for j in owners[i]])
        return ops.stack(matrix), tensors

    # --- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Give the model back its own train function and close the link."""
        self._restore()
        self._in_step = False
        self._compiled.clear()
        StepReporter.close(self)


def _recording(layer: Any, index: int, call: Any, seen: _Captured) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        tensor = out if keras.ops.is_tensor(out) else _first_tensor(out)
        if tensor is not None and "float" in str(keras.backend.standardize_dtype(tensor.dtype)):
            axis = kerasstats.unit_axis(layer, len(tensor.shape))
            seen.rows[index] = kerasstats.activation(tensor, axis)  # a shared layer: the last call
            if index in seen.keep:
                seen.kept[index] = keras.ops.stop_gradient(tensor)
        return out

    return wrapped


def to_host(x: Any) -> Any:
    return arrays.to_numpy(x).copy()  # a copy: a torch tensor's numpy view shares memory


def _first_tensor(out: Any) -> Any:
    return next((t for t in keras.tree.flatten(out) if keras.ops.is_tensor(t)), None)


def _loss_of(logs: Any) -> Any:
    """The loss Keras logged (its running mean over the epoch), else any logged value."""
    if not isinstance(logs, dict) or not logs:
        return None
    return logs.get("loss", next(iter(logs.values())))
