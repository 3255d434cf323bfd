"""devbox.probe: live statistics of a model's layers, from inside the training process.

    from devbox import probe
    probe.watch(model, every=50)        # PyTorch: then train as usual
    model.fit(x, y, callbacks=[probe.watch(model)])            # Keras 3, any backend
    watcher = probe.watch(model)        # Flax NNX: @watcher.jit and watcher.value_and_grad

Every `every` steps while somebody watches (`devbox probe NAME`, the TUI's model screen) it
sends, per layer, the output's mean, std, abs max, zero and dead-unit fractions and NaN/Inf
counts, the parameters' gradient and weight norms and the update/weight ratio of the
optimizer step, to the box's agent; it answers requests for a layer's histogram, a tensor's
summary or a saved copy at the next step; and it raises alerts (NaN/Inf, exploding or
vanishing gradients, dead units); between reports it checks at every step that the model's
output is finite. While nobody watches it only does that check, at report steps. It never
raises into training: with no agent, or a dead one, it goes quiet and reconnects.

Before the box is released (by `devbox down` or the autoscaler) the agent asks the process
to save, and reports what it saved:

    probe.on_release(lambda reason: save_checkpoint("ckpt.pt"))   # returns what it saved

`save_fn(reason)` returns a path, several, or None; it runs once, on the training thread at
the next step boundary when a watched model is training (else on a thread of its own), and
its exception is reported, never raised into training. A loop can poll instead:

    if probe.release_requested():
        torch.save(model.state_dict(), "ckpt.pt")
        probe.saved("ckpt.pt")

Either works without `watch`. While the process seems hung, `devbox probe NAME --stacks`
shows every thread's stack: the probe's own thread answers it.

`import devbox.probe` imports no framework; `watch` imports the model's own (which it
tells by the model's class, without importing any), so a box needs only the one it trains
with. The agent and `devbox probe` show which one a process hooks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

from devbox.probe.alerts import Thresholds
from devbox.probe.release import on_release, release_requested, saved
from devbox.probe.reporting import check_every

__all__ = [
    "ProbeUnavailable",
    "Thresholds",
    "on_release",
    "release_requested",
    "saved",
    "watch",
]


class ProbeUnavailable(ImportError):
    """devbox.probe was used where the model's framework is not installed."""


# Where a model's class comes from (its module's top package, over the class's MRO) says
# which watcher hooks it. Checked by name, so that nothing is imported to find out.
_FRAMEWORKS = {"keras": "Keras 3", "flax": "Flax NNX", "torch": "PyTorch"}


def _framework(model: Any) -> str | None:
    for cls in type(model).__mro__:
        top = cls.__module__.partition(".")[0]
        if top in _FRAMEWORKS:
            return top
    return None


def watch(
    model: Any,
    *,
    every: int = 50,
    layers: Sequence[str] | None = None,
    thresholds: Thresholds | None = None,
    find_socket: Callable[[], str | None] | None = None,
) -> Any:
    """Hook `model`: a torch.nn.Module, a Keras 3 model (on any backend) or a Flax NNX
    module. `every`: steps between reports while watched; `layers`: layer names or fnmatch
    patterns (default: every leaf layer). Returns the watcher; its close() unhooks.

    PyTorch: train as usual (the optimizer's steps are found by torch's global hooks).
    Keras: the watcher is a callback, `model.fit(..., callbacks=[probe.watch(model)])`.
    NNX: decorate the train step with the watcher's `jit` (for `nnx.jit`) and take the
    gradients with its `value_and_grad` (for `nnx.value_and_grad`); statistics are computed
    inside the compiled step on observed steps only."""
    check_every(every, "devbox.probe.watch")
    if isinstance(layers, str):
        layers = [layers]
    limits = thresholds or Thresholds()
    kind = _framework(model)
    if kind == "keras":
        from devbox.probe.kerasprobe import watch_keras

        return watch_keras(
            model, every=every, layers=layers, thresholds=limits, find_socket=find_socket
        )
    if kind == "flax":
        from devbox.probe.nnxprobe import watch_nnx

        return watch_nnx(
            model, every=every, layers=layers, thresholds=limits, find_socket=find_socket
        )
    if kind == "torch":
        from devbox.probe.watcher import Watcher

        return Watcher(
            model, every=every, layers=layers, thresholds=limits, find_socket=find_socket
        )
    installed = [
        name for top, name in _FRAMEWORKS.items() if importlib.util.find_spec(top) is not None
    ]
    if not installed:
        raise ProbeUnavailable(
            "devbox.probe needs PyTorch, Keras 3 or Flax NNX in this Python environment "
            "(none is installed)"
        )
    raise TypeError(
        "devbox.probe.watch needs a torch.nn.Module, a Keras 3 model or a Flax NNX module, "
        f"not {type(model).__name__}"
    )
