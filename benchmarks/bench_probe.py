"""What devbox.probe costs a training loop, against no probe and against wandb.watch.

One process, five copies of one model (same seed), one per variant: no probe, the probe
reporting every step (every step observed) and every N, and wandb.watch(model, log="all",
log_freq=same) in offline mode. The probe reports to an in-process stand-in for the agent
that says "watching" and reads every frame, so it does its full work. The variants take
turns step by step (each cycle one step of each, the order rotating), so that a shared
machine's drift, which moves a step's cost by 30% within seconds, hits all of them alike;
the cycles are grouped in windows of N, each with exactly one observed step of the every-N
probe, and every ratio is the median over windows of the ratio within a window. Then
torch.compile: the probe on a compiled model, counting graphs compiled after warm-up (it
must be none).

    python benchmarks/bench_probe.py [--windows 12] [--every 50] [--device cpu|cuda]

A step's cost on the CPU is the training thread's CPU time (one intra-op thread, so all
of the step's work), plus for a probe the CPU time of its link thread in the same window
(charged to its observed steps). wandb's own threads and its service process are not
counted, which favours wandb. On CUDA it is wall time, with a synchronize per step for
the clock only. Prints JSON: ms per step for each variant, overheads, probe/wandb ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not __package__:
    # Run as a file: the repo's root on the path, as under `python -m` (see bench_throughput).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import probe_sink, wait_connected
from devbox import probe


def make_model(width: int, depth: int, device: str) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers).to(device)


class Loop:
    def __init__(self, model: torch.nn.Module, *, batch: int, width: int, device: str) -> None:
        self.model = model
        self.run: Callable[[torch.Tensor], torch.Tensor] = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width, device=device)
        self.y = torch.randn(batch, 1, device=device)
        self.cuda = device == "cuda"
        self.clock = time.perf_counter

    def step(self) -> float:
        clock = self.clock
        start = clock()
        self.optimizer.zero_grad(set_to_none=True)
        loss = ((self.run(self.x) - self.y) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize()  # for the clock only; the probe never does this
        return clock() - start

    def steps(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]


def measure(args: argparse.Namespace, path: str) -> dict[str, Any]:
    import wandb

    every = args.every
    variants = ["none", "probe_every_1", f"probe_every_{every}", "wandb_every_1"]
    variants.append(f"wandb_every_{every}")
    cpu = args.clock == "cpu" or (args.clock is None and args.device != "cuda")
    loops: dict[str, Loop] = {}
    for variant in variants:
        torch.manual_seed(0)
        model = make_model(args.width, args.depth, args.device)
        loops[variant] = Loop(model, batch=args.batch, width=args.width, device=args.device)
        if cpu:
            loops[variant].clock = time.thread_time
    # wandb's service process starts first: its start-up must not land in a measurement.
    # Its offline run files go in the sink's folder, which goes at the end.
    run = wandb.init(project="devbox-bench", mode="offline", dir=os.path.dirname(path))
    time.sleep(2.0)
    watchers: dict[str, Any] = {}
    for variant in variants:
        n = int(variant.rsplit("_", 1)[1]) if variant != "none" else 0
        if variant.startswith("probe"):
            watchers[variant] = probe.watch(loops[variant].model, every=n, find_socket=lambda: path)
            wait_connected(watchers[variant])
        elif variant.startswith("wandb"):
            wandb.watch(loops[variant].model, log="all", log_freq=n)
    for loop in loops.values():
        loop.steps(args.warmup)  # the first report pays one-time costs (pinned buffers)
    sparse = watchers[f"probe_every_{every}"]
    while sparse.step % every:
        loops[f"probe_every_{every}"].step()  # windows start at an observed step

    def link_cpu() -> dict[str, float]:
        return {v: w.link.cpu_time() if cpu else 0.0 for v, w in watchers.items()}

    windows: list[dict[str, float]] = []
    cycle = 0
    for _ in range(args.windows):
        spent = dict.fromkeys(variants, 0.0)
        observed = unobserved = 0.0
        links = link_cpu()
        for _ in range(every):
            order = variants[cycle % len(variants) :] + variants[: cycle % len(variants)]
            cycle += 1
            for variant in order:
                due = variant == f"probe_every_{every}" and sparse.step % every == 0
                t = loops[variant].step()
                spent[variant] += t
                if due:
                    observed += t
                elif variant == f"probe_every_{every}":
                    unobserved += t
        now = link_cpu()
        for variant, before in links.items():
            spent[variant] += now[variant] - before
        # The link thread's work in a window is the observed step's report.
        observed += now[f"probe_every_{every}"] - links[f"probe_every_{every}"]
        window = {v: spent[v] / every for v in variants}
        window[f"probe_every_{every}_observed_steps"] = observed
        window[f"probe_every_{every}_unobserved_steps"] = unobserved / max(1, every - 1)
        windows.append(window)
    for watcher in watchers.values():
        watcher.close()
    run.finish()

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(w[a] / w[b] for w in windows), 4)

    keys = list(windows[0])
    return {
        "ms_per_step_median_of_windows": {
            k: round(1e3 * statistics.median(w[k] for w in windows), 3) for k in keys
        },
        "overhead_vs_none": {
            f"probe_every_{every}_mean_step": round(ratio(f"probe_every_{every}", "none") - 1, 4),
            f"probe_every_{every}_unobserved_steps": round(
                ratio(f"probe_every_{every}_unobserved_steps", "none") - 1, 4
            ),
            f"probe_every_{every}_observed_steps": round(
                ratio(f"probe_every_{every}_observed_steps", "none") - 1, 4
            ),
            "probe_observed_steps (every=1)": round(ratio("probe_every_1", "none") - 1, 4),
            f"wandb_every_{every}_mean_step": round(ratio(f"wandb_every_{every}", "none") - 1, 4),
            "wandb_every_1": round(ratio("wandb_every_1", "none") - 1, 4),
        },
        "probe_over_wandb": {
            f"every_{every}": ratio(f"probe_every_{every}", f"wandb_every_{every}"),
            "every_1": ratio("probe_every_1", "wandb_every_1"),
        },
        "windows": len(windows),
        "steps_per_variant": len(windows) * every,
    }


def compiled(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """The probe on a torch.compile'd model: graphs compiled after warm-up (both the
    observed and the unobserved variant were seen) must be zero."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model(args.width, args.depth, args.device)
    loop = Loop(model, batch=args.batch, width=args.width, device=args.device)
    watcher = probe.watch(model, every=args.compile_every, find_socket=lambda: path)
    wait_connected(watcher)
    loop.run = torch.compile(model)
    loop.steps(2 * args.compile_every)  # warm-up: observed and unobserved steps
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    loop.steps(4 * args.compile_every)
    watcher.close()
    return {
        "every": args.compile_every,
        "graphs_at_warmup": graphs,
        "graphs_compiled_after_warmup": counters["stats"]["unique_graphs"] - graphs,
        "recompiles_after_warmup": sum(counters["recompiles"].values()) - recompiles,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--windows", type=int, default=12, help="windows of --every cycles")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--compile-every", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile part")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        help="what a step costs: the process's CPU time (all its threads, the probe's own "
        "included; steady on a shared machine) or wall time (default: cpu on the CPU, wall "
        "on CUDA, where the device's time is the cost)",
    )
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    # One intra-op thread on the CPU: the process's CPU time is then the step's whole cost,
    # and other users of a shared machine do not stretch it.
    torch.set_num_threads(1)
    clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    with probe_sink() as path:
        result: dict[str, Any] = {
            "device": args.device,
            "torch": torch.__version__,
            "model": f"MLP {args.depth}x{args.width}, batch {args.batch}, Adam",
            "clock": clock,
            **measure(args, path),
        }
        if not args.no_compile:
            result["compile"] = compiled(args, path)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
