"""A small Flax NNX model trained with devbox.probe, as a researcher would, plus a reference:
the same statistics computed directly (eagerly, in numpy, outside the probe) at every step,
written to --ref as JSON lines, for the tests to compare with what the probe sent."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from devbox import probe


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)
        self.l3 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.l3(jnp.tanh(self.l2(jax.nn.relu(self.l1(x)))))


def loss_fn(model: MLP, x: Any, y: Any) -> Any:
    return jnp.mean((model(x) - y) ** 2)


def norm(arrays: list[Any]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays))


def reference(model: MLP, x: Any, y: Any) -> dict[str, dict[str, Any]]:
    """Each layer's output statistics, gradient and weight norms, computed eagerly."""
    grads = nnx.grad(loss_fn)(model, x, y)
    h1 = model.l1(x)
    h2 = model.l2(jax.nn.relu(h1))
    h3 = model.l3(jnp.tanh(h2))
    layers = {}
    for name, out in (("l1", h1), ("l2", h2), ("l3", h3)):
        o = np.asarray(out, np.float64)
        layer = getattr(model, name)
        layers[name] = {
            "act_mean": float(o.mean()),
            "act_std": float(o.std()),
            "act_absmax": float(np.abs(o).max()),
            "act_zeros": float((o == 0).mean()),
            "act_nan": int(np.isnan(o).sum()),
            "grad_norm": norm(
                [getattr(grads, name).kernel.get_value(), getattr(grads, name).bias.get_value()]
            ),
            "weight_norm": norm([layer.kernel.get_value(), layer.bias.get_value()]),
        }
    return layers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0, help="0: until killed")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--nan-at", type=int, default=-1)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--ref", required=True)
    args = p.parse_args()

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    watcher = probe.watch(model, every=args.every)

    @watcher.jit
    def train_step(model: MLP, optimizer: nnx.Optimizer, x: Any, y: Any) -> Any:
        loss, grads = watcher.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    ref = open(args.ref, "w", buffering=1)  # noqa: SIM115
    step = 0
    while args.steps == 0 or step < args.steps:
        x = rng.standard_normal((64, 8)).astype(np.float32)
        if step == args.nan_at:
            x[3, 2] = math.nan
        y = x.sum(1, keepdims=True)
        layers = reference(model, x, y)
        before = {
            n: [getattr(model, n).kernel.get_value(), getattr(model, n).bias.get_value()]
            for n in layers
        }
        loss = train_step(model, optimizer, x, y)
        for name in layers:
            after = [getattr(model, name).kernel.get_value(), getattr(model, name).bias.get_value()]
            moved = norm([a - b for a, b in zip(after, before[name], strict=True)])
            layers[name]["update_ratio"] = moved / layers[name]["weight_norm"]
        ref.write(json.dumps({"step": step, "loss": float(loss), "layers": layers}) + "\n")
        step += 1
        time.sleep(args.sleep)


if __name__ == "__main__":
    main()
