"""devbox.probe: live statistics of a model's layers, from inside the training process.

    from devbox import probe
    probe.watch(model, every=50)        # then train as usual

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

`import devbox.probe` does not import torch; `watch` does, and says so when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from devbox.probe.alerts import Thresholds
from devbox.probe.release import on_release, release_requested, saved

if TYPE_CHECKING:
    from devbox.probe.watcher import Watcher

__all__ = [
    "ProbeUnavailable",
    "Thresholds",
    "on_release",
    "release_requested",
    "saved",
    "watch",
]


class ProbeUnavailable(ImportError):
    """devbox.probe was used where PyTorch is not installed."""


def watch(
    model: Any,
    *,
    every: int = 50,
    layers: Sequence[str] | None = None,
    thresholds: Thresholds | None = None,
    find_socket: Callable[[], str | None] | None = None,
) -> Watcher:
    """Hook `model` (a torch.nn.Module). `every`: steps between reports while watched;
    `layers`: module names or fnmatch patterns (default: every leaf module). Returns the
    watcher; its close() removes the hooks."""
    try:
        import torch
    except ImportError:
        raise ProbeUnavailable(
            "devbox.probe needs PyTorch in this Python environment (pip install torch)"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"devbox.probe.watch needs a torch.nn.Module, not {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"devbox.probe.watch: every must be a whole number >= 1, not {every!r}")
    if isinstance(layers, str):
        layers = [layers]
    from devbox.probe.watcher import Watcher

    return Watcher(
        model,
        every=every,
        layers=layers,
        thresholds=thresholds or Thresholds(),
        find_socket=find_socket,
    )
