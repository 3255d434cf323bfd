"""A small Keras 3 model trained by model.fit with devbox.probe, as a researcher would, plus
a reference: the same statistics computed directly (a numpy forward and backward pass of
the MLP, from the weights before and after each step), written to --ref as JSON lines, for
the tests to compare with what the probe sent. Also imported by tests/probe/test_keras_unit.py
(make_model, batches, Reference), with KERAS_BACKEND set by the importer."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, TextIO

BATCH = 64


def make_model() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", name="dense"),
            keras.layers.Dense(16, activation="tanh", name="dense_1"),
            keras.layers.Dense(1, name="dense_2"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def batches(steps: int, nan_at: int = -1) -> tuple[Any, Any]:
    """`steps` batches of BATCH samples, one epoch (fit with shuffle=False)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * BATCH, 8)).astype("float32")
    y = x.sum(1, keepdims=True)
    if 0 <= nan_at < steps:
        x[nan_at * BATCH + 3, 2] = math.nan
    return x, y


def forward_backward(x: Any, y: Any, weights: list[list[Any]]) -> tuple[Any, Any]:
    """(the three layers' outputs, their [kernel, bias] gradients of the MSE loss), by
    numpy in float64."""
    import numpy as np

    (w1, b1), (w2, b2), (w3, b3) = [[np.asarray(a, np.float64) for a in ws] for ws in weights]
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    h1 = np.maximum(x @ w1 + b1, 0.0)
    h2 = np.tanh(h1 @ w2 + b2)
    out = h2 @ w3 + b3
    d3 = 2.0 * (out - y) / out.size
    d2 = (d3 @ w3.T) * (1.0 - h2 * h2)
    d1 = (d2 @ w2.T) * (h1 > 0)
    grads = [(x.T @ d1, d1.sum(0)), (h1.T @ d2, d2.sum(0)), (h2.T @ d3, d3.sum(0))]
    return (h1, h2, out), grads


def statistics(x: Any, y: Any, weights: list[list[Any]]) -> dict[str, dict[str, Any]]:
    """The probe's statistics of one step: activations, gradient and weight norms (the
    weights before the update)."""
    import numpy as np

    (h1, h2, out), grads = forward_backward(x, y, weights)
    (w1, b1), (w2, b2), (w3, b3) = [[np.asarray(a, np.float64) for a in ws] for ws in weights]
    layers: dict[str, dict[str, Any]] = {}
    for name, act, (gw, gb), (w, b) in zip(
        ("dense", "dense_1", "dense_2"),
        (h1, h2, out),
        grads,
        ((w1, b1), (w2, b2), (w3, b3)),
        strict=True,
    ):
        layers[name] = {
            "act_mean": float(act.mean()),
            "act_std": float(act.std()),
            "act_absmax": float(np.abs(act).max()),
            "act_zeros": float((act == 0).mean()),
            "act_dead": float((np.abs(act).max(0) == 0).mean()),
            "act_nan": int(np.isnan(act).sum()),
            "grad_norm": math.sqrt(float((gw * gw).sum() + (gb * gb).sum())),
            "weight_norm": math.sqrt(float((w * w).sum() + (b * b).sum())),
        }
    return layers


def make_reference(out: TextIO, x: Any, y: Any, sleep: float = 0.0) -> Any:
    """A callback (put after the probe's) that writes each step's statistics to `out`."""
    import keras
    import numpy as np

    class Reference(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.step, self.steps_per_epoch = 0, len(x) // BATCH
            self.before: list[list[Any]] = []
            self.layers: dict[str, dict[str, Any]] = {}

        def _weights(self) -> list[list[Any]]:
            # self.model syncs Keras's JAX state into the variables first.
            return [[np.array(w) for w in layer.get_weights()] for layer in self.model.layers]

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rows = slice(batch * BATCH, (batch + 1) * BATCH)
            self.before = self._weights()
            self.layers = statistics(x[rows], y[rows], self.before)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            for stats, old, new in zip(
                self.layers.values(), self.before, self._weights(), strict=True
            ):
                moved = math.sqrt(
                    sum(float(((a - b) ** 2).sum()) for a, b in zip(new, old, strict=True))
                )
                stats["update_ratio"] = moved / stats["weight_norm"]
            line = {"step": self.step, "loss": float((logs or {}).get("loss", math.nan))}
            out.write(json.dumps({**line, "layers": self.layers}) + "\n")
            self.step += 1
            if sleep:
                time.sleep(sleep)

    return Reference()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0, help="0: until killed")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--backend", default="jax", choices=["jax", "torch", "tensorflow"])
    p.add_argument("--ref", required=True)
    args = p.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend  # before keras is first imported

    from devbox import probe

    model = make_model()
    per_epoch = args.steps or 100
    x, y = batches(per_epoch, args.nan_at)
    ref = open(args.ref, "w", buffering=1)  # noqa: SIM115
    callbacks = [probe.watch(model, every=args.every), make_reference(ref, x, y, args.sleep)]
    epochs = 1 if args.steps else sys.maxsize
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main()
