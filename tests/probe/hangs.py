"""A training loop that saves before its box is released (probe.on_release) and, when
told to, hangs the way a stuck collective does: the training thread waits forever inside
`stuck_here` while its GPUs (simulated) stay busy. For tests/probe/test_hang_e2e.py.

--never-answer: the save function never returns (a save stuck on a dead filesystem)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch

from devbox import probe

p = argparse.ArgumentParser()
p.add_argument("--ckpt", required=True, help="where the save before release writes")
p.add_argument("--hang-file", required=True, help="once it exists, the loop hangs")
p.add_argument("--steps-file", required=True, help="the step count, rewritten as it goes")
p.add_argument("--never-answer", action="store_true")
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
# Reports every 1000 steps: only the probe's liveness beat says that steps go on.
probe.watch(model, every=1000)
step = 0


def save(reason: str) -> str:
    if args.never_answer:
        threading.Event().wait()
    tmp = args.ckpt + ".tmp"
    torch.save({"step": step, "reason": reason, "model": model.state_dict()}, tmp)
    os.replace(tmp, args.ckpt)
    return str(args.ckpt)


probe.on_release(save)


def stuck_here() -> None:
    threading.Event().wait()  # as an all-reduce that a lost rank never joins


while True:
    if os.path.exists(args.hang_file):
        stuck_here()
    x = torch.randn(32, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % 20 == 0:
        Path(args.steps_file).write_text(str(step))
    time.sleep(0.02)
