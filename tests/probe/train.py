"""A small model trained with devbox.probe, as a researcher would, plus a reference: the
same statistics computed directly with plain torch at every step, written to --ref as JSON
lines, for the tests to compare with what `devbox probe` received."""

from __future__ import annotations

import argparse
import json
import math
import threading
import time

import torch

from devbox import probe

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=0, help="0: until killed")
p.add_argument("--every", type=int, default=5)
p.add_argument("--nan-at", type=int, default=-1)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--stuck-at", type=int, default=-1, help="hang at this step, as a deadlock")
p.add_argument("--ref", required=True)
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32),
    torch.nn.ReLU(),
    torch.nn.Linear(32, 16),
    torch.nn.Tanh(),
    torch.nn.Linear(16, 1),
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
probe.watch(model, every=args.every)

outputs: dict[str, torch.Tensor] = {}
for name, module in model.named_children():
    module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out))


def stuck_here() -> None:
    threading.Event().wait()


ref = open(args.ref, "w", buffering=1)  # noqa: SIM115
step = 0
while args.steps == 0 or step < args.steps:
    x = torch.randn(64, 8)
    if step == args.nan_at:
        x[3, 2] = math.nan
    y = x.sum(1, keepdim=True)
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    before = {n: [q.detach().clone() for q in m.parameters()] for n, m in model.named_children()}
    layers = {}
    for name, module in model.named_children():
        out = outputs[name].detach()
        params = list(module.parameters())
        grad = math.sqrt(sum(float(q.grad.norm()) ** 2 for q in params)) if params else None
        weight = math.sqrt(sum(float(q.norm()) ** 2 for q in params)) if params else None
        layers[name] = {
            "act_mean": float(out.mean()),
            "act_std": float(out.std(unbiased=False)),
            "act_absmax": float(out.abs().max()),
            "act_zeros": float((out == 0).float().mean()),
            "act_nan": int(out.isnan().sum()),
            "grad_norm": grad,
            "weight_norm": weight,
        }
    optimizer.step()
    for name, module in model.named_children():
        params = list(module.parameters())
        weight = layers[name]["weight_norm"]  # None exactly when there are no params
        if params and weight is not None:
            moved = math.sqrt(
                sum(float((q - b).norm()) ** 2 for q, b in zip(params, before[name], strict=True))
            )
            layers[name]["update_ratio"] = moved / weight
    ref.write(json.dumps({"step": step, "loss": float(loss), "layers": layers}) + "\n")
    step += 1
    if step == args.stuck_at:
        stuck_here()
    time.sleep(args.sleep)
