"""A training process that saves before its box is released, in one of the ways the tests
try (`--mode`), writing what it did under --out: `steps` (how many steps it made), the
checkpoint `ckpt.txt` (the name of the thread that saved it)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import torch

from devbox import probe

MODES = ("step", "idle", "raise", "block", "die", "poll", "poll-never", "watch-only", "stuck")
p = argparse.ArgumentParser()
p.add_argument("--mode", choices=MODES, required=True)
p.add_argument("--out", type=Path, required=True)
args = p.parse_args()

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
checkpoint: Path = args.out / "ckpt.txt"


def save(reason: str) -> Path:
    if args.mode == "raise":
        raise OSError(f"disk full\nwhile saving for {reason}")
    if args.mode == "block":
        threading.Event().wait()
    if args.mode == "die":
        os._exit(3)
    checkpoint.write_text(f"{threading.current_thread().name} {reason}")
    return checkpoint


def stuck_here() -> None:
    threading.Event().wait()


if args.mode != "watch-only":
    if args.mode.startswith("poll"):
        probe.release_requested()
    else:
        probe.on_release(save)
if args.mode != "poll":  # one polling process without a Watcher: the release link alone
    probe.watch(model, every=1000)

step = 0
while True:
    optimizer.zero_grad()
    model(torch.randn(16, 4)).square().mean().backward()
    optimizer.step()
    step += 1
    (args.out / "steps").write_text(str(step))
    if args.mode == "poll" and probe.release_requested() and not checkpoint.exists():
        checkpoint.write_text(f"{threading.current_thread().name} polled")
        probe.saved(checkpoint)
    if args.mode == "idle" and step == 3:
        time.sleep(3600)  # training is over; the REPL waits
    if args.mode == "stuck" and step == 3:
        stuck_here()
    time.sleep(0.01)
