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

`import devbox.probe` does not import torch; `watch` does, and says so when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from devbox.probe.alerts import Thresholds

if TYPE_CHECKING:
    from devbox.probe.watcher import Watcher

__all__ = ["ProbeUnavailable", "Thresholds", "watch"]


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
