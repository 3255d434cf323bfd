"""What devbox.probe costs a training step in each framework, against TensorBoard histogram
logging of the same model at the same frequency.

Per framework (PyTorch; Flax NNX on JAX; Keras 3 on JAX and on PyTorch), in a process of
its own (Keras picks its backend once per process): one MLP (--depth Dense layers of
--width, ReLU, then one output), five copies from one seed, one per variant:

  none                    no probe, no logging
  probe_every_N / _1      devbox.probe reporting every N steps / every step, to an in-process
                          stand-in for the agent that says "watching" and reads every frame
  tensorboard_every_N / _1  tensorboardX histograms of every layer's weights, output and
                          (where the framework hands them over: torch, NNX) gradients,
                          the usual way for that framework, every N steps / every step

The variants take turns, a chunk of N steps each in a rotating order, so a shared machine's
drift hits all of them alike; each ratio is the median over windows of the ratio within a
window. A chunk's cost is the process's CPU time (all its threads: the probe's link thread,
TensorBoard's writer; each framework computes on one thread, so idle pool threads spinning
are not counted), or wall time with --clock wall.

    python benchmarks/bench_frameworks.py [--frameworks torch,nnx,keras-jax,keras-torch]
        [--windows 8] [--every 50]

Prints JSON: ms per step per variant and framework, overheads against none, probe over
tensorboard ratios, and a `met` block: the probe at every N and every 1 costs less than
TensorBoard at the same frequency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a file: the repo's root on the path, as under `python -m` (see bench_throughput).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness import emit, probe_sink, wait_connected

FRAMEWORKS = ("torch", "nnx", "keras-jax", "keras-torch")
Chunk = Callable[[int], None]  # runs that many training steps, and waits for them


def variants(every: int) -> list[str]:
    probes = [f"probe_every_{every}", "probe_every_1"]
    return ["none", *probes, f"tensorboard_every_{every}", "tensorboard_every_1"]


def _frequency(variant: str) -> int:
    return int(variant.rsplit("_", 1)[1])


# --- PyTorch ------------------------------------------------------------------------------


def torch_chunks(args: argparse.Namespace, sink: str, logdir: str) -> dict[str, Chunk]:
    import torch

    from devbox import probe

    torch.set_num_threads(1)  # see child_env

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)

    def loop(
        model: torch.nn.Module, opt: torch.optim.Optimizer, after: Callable[[], None] | None
    ) -> Chunk:
        def chunk(n: int) -> None:
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                if after is not None:
                    after()

        return chunk

    chunks: dict[str, Chunk] = {}
    for variant in variants(args.every):
        model, opt = build()
        if variant == "none":
            chunks[variant] = loop(model, opt, None)
        elif variant.startswith("probe"):
            watcher = probe.watch(model, every=_frequency(variant), find_socket=lambda: sink)
            wait_connected(watcher)
            chunks[variant] = loop(model, opt, None)
        else:
            chunks[variant] = loop(model, opt, _torch_tensorboard(model, variant, logdir))
    return chunks


def _torch_tensorboard(model: Any, variant: str, logdir: str) -> Callable[[], None]:
    from tensorboardX import SummaryWriter

    every, writer = _frequency(variant), SummaryWriter(os.path.join(logdir, variant))
    outputs: dict[str, Any] = {}
    state = {"step": 0}
    for name, module in model.named_children():
        module.register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out.detach())
        )

    def after() -> None:
        step = state["step"]
        state["step"] += 1
        if step % every:
            return
        for name, module in model.named_children():
            writer.add_histogram(f"{name}/output", outputs[name], step)
            for pname, p in module.named_parameters():
                writer.add_histogram(f"{name}/{pname}", p.detach(), step)
                if p.grad is not None:
                    writer.add_histogram(f"{name}/{pname}/grad", p.grad, step)

    return after


# --- Flax NNX -----------------------------------------------------------------------------


def nnx_chunks(args: argparse.Namespace, sink: str, logdir: str) -> dict[str, Chunk]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tensorboardX import SummaryWriter

    from devbox import probe

    class MLP(nnx.Module):
        def __init__(self, width: int, depth: int, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
            self.head = nnx.Linear(width, 1, rngs=rngs)

        def outputs(self, x: Any) -> list[Any]:
            out = []
            for layer in self.hidden:
                x = jax.nn.relu(layer(x))
                out.append(x)
            out.append(self.head(x))
            return out

        def __call__(self, x: Any) -> Any:
            return self.outputs(x)[-1]

    def loss_fn(model: MLP, x: Any, y: Any) -> Any:
        return ((model(x) - y) ** 2).mean()

    def loss_and_outputs(model: MLP, x: Any, y: Any) -> Any:
        out = model.outputs(x)
        return ((out[-1] - y) ** 2).mean(), out

    key = jax.random.key(1)
    x = jax.random.normal(key, (args.batch, args.width))
    y = jax.random.normal(jax.random.key(2), (args.batch, 1))
    chunks: dict[str, Chunk] = {}
    for variant in variants(args.every):
        model = MLP(args.width, args.depth, nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
        if variant.startswith("probe"):
            watcher = probe.watch(model, every=_frequency(variant), find_socket=lambda: sink)
            wait_connected(watcher)

            @watcher.jit
            def probed(model: MLP, opt: Any, x: Any, y: Any, watcher: Any = watcher) -> Any:
                loss, grads = watcher.value_and_grad(loss_fn)(model, x, y)
                opt.update(model, grads)
                return loss

            chunks[variant] = _jax_loop(probed, model, opt, x, y)
            continue

        @nnx.jit
        def plain(model: MLP, opt: Any, x: Any, y: Any) -> Any:
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            opt.update(model, grads)
            return loss

        if variant == "none":
            chunks[variant] = _jax_loop(plain, model, opt, x, y)
            continue

        @nnx.jit
        def logged(model: MLP, opt: Any, x: Any, y: Any) -> Any:
            (loss, outs), grads = nnx.value_and_grad(loss_and_outputs, has_aux=True)(model, x, y)
            opt.update(model, grads)
            return loss, outs, grads

        writer = SummaryWriter(os.path.join(logdir, variant))

        def chunk(
            n: int,
            model: MLP = model,
            opt: Any = opt,
            every: int = _frequency(variant),
            writer: Any = writer,
            plain: Any = plain,
            logged: Any = logged,
            state: dict[str, int] = {"step": 0},  # noqa: B006 (one per variant, on purpose)
        ) -> None:
            loss = None
            for _ in range(n):
                step = state["step"]
                state["step"] += 1
                if step % every:
                    loss = plain(model, opt, x, y)
                    continue
                loss, outs, grads = logged(model, opt, x, y)
                for i, out in enumerate(outs):
                    writer.add_histogram(f"layer{i}/output", np.asarray(out), step)
                for tree, kind in ((grads, "grad"), (nnx.state(model, nnx.Param), "weight")):
                    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                        name = jax.tree_util.keystr(path)
                        writer.add_histogram(f"{name}/{kind}", np.asarray(leaf), step)
            jnp.asarray(loss).block_until_ready()

        chunks[variant] = chunk
    return chunks


def _jax_loop(step: Any, model: Any, opt: Any, x: Any, y: Any) -> Chunk:
    def chunk(n: int) -> None:
        loss: Any = None
        for _ in range(n):
            loss = step(model, opt, x, y)
        loss.block_until_ready()  # jax dispatches asynchronously: the chunk's work is done

    return chunk


# --- Keras 3 ------------------------------------------------------------------------------


def keras_chunks(args: argparse.Namespace, sink: str, logdir: str) -> dict[str, Chunk]:
    import keras
    import numpy as np

    from devbox import probe

    rng = np.random.default_rng(0)
    batches = 1 + args.every  # enough data for the longest chunk
    x = rng.standard_normal((batches * args.batch, args.width), dtype=np.float32)
    y = rng.standard_normal((batches * args.batch, 1), dtype=np.float32)

    def build() -> Any:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
        model = keras.Sequential([keras.Input((args.width,)), *layers, keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        return model

    chunks: dict[str, Chunk] = {}
    for variant in variants(args.every):
        model = build()
        callbacks: list[Any] = []
        if variant.startswith("probe"):
            watcher = probe.watch(model, every=_frequency(variant), find_socket=lambda: sink)
            wait_connected(watcher)
            callbacks = [watcher]
        elif variant.startswith("tensorboard"):
            callbacks = [_keras_tensorboard(model, x[: args.batch], variant, logdir)]

        def chunk(n: int, model: Any = model, callbacks: list[Any] = callbacks) -> None:
            model.fit(
                x[: n * args.batch],
                y[: n * args.batch],
                batch_size=args.batch,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )

        chunks[variant] = chunk
    return chunks


def _keras_tensorboard(model: Any, sample: Any, variant: str, logdir: str) -> Any:
    """Histograms of every layer's weights and of its output on a fixed batch (a Keras
    callback is not handed the batch, nor the gradients: Keras's own TensorBoard callback
    logs weights only, per epoch), every N steps, with tensorboardX."""
    import keras
    from tensorboardX import SummaryWriter

    every, writer = _frequency(variant), SummaryWriter(os.path.join(logdir, variant))
    taps = keras.Model(model.inputs, [layer.output for layer in model.layers])

    class Histograms(keras.callbacks.Callback):
        step = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = self.step
            self.step += 1
            if step % every:
                return
            # Callback.model syncs the weights back from Keras's training state (on JAX
            # they are not in the variables during fit): what any callback that reads
            # them pays.
            layers = self.model.layers
            for layer, out in zip(layers, taps(sample, training=False), strict=True):
                writer.add_histogram(f"{layer.name}/output", keras.ops.convert_to_numpy(out), step)
                for w in layer.weights:
                    value = keras.ops.convert_to_numpy(w.value)
                    writer.add_histogram(f"{layer.name}/{w.name}", value, step)

    return Histograms()


# --- the measurement ----------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with probe_sink() as sink, tempfile.TemporaryDirectory(prefix="dbx-tb-") as logdir:
        if args.child == "torch":
            chunks = torch_chunks(args, sink, logdir)
        elif args.child == "nnx":
            chunks = nnx_chunks(args, sink, logdir)
        else:
            chunks = keras_chunks(args, sink, logdir)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        names = list(chunks)
        for chunk in chunks.values():
            chunk(args.warmup)  # compilation, and the first report's one-time costs
        windows: list[dict[str, float]] = []
        for w in range(args.windows):
            order = names[w % len(names) :] + names[: w % len(names)]
            window = {}
            for name in order:
                start = clock()
                chunks[name](args.every)
                window[name] = (clock() - start) / args.every
            windows.append(window)

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(w[a] / w[b] for w in windows), 3)

    every = args.every
    return {
        "ms_per_step_median_of_windows": {
            n: round(1e3 * statistics.median(w[n] for w in windows), 3) for n in names
        },
        "overhead_vs_none": {n: round(ratio(n, "none") - 1, 3) for n in names if n != "none"},
        "probe_over_tensorboard": {
            f"every_{every}": ratio(f"probe_every_{every}", f"tensorboard_every_{every}"),
            "every_1": ratio("probe_every_1", "tensorboard_every_1"),
        },
        "windows": len(windows),
        "steps_per_variant": len(windows) * every,
    }


def child_env(framework: str, scratch: str) -> dict[str, str]:
    env = dict(os.environ)
    # TorchInductor's cache (Keras on torch makes one, under the temporary folder by
    # default) goes in a folder removed after the child. Not all of TMPDIR: the probe's
    # socket is made there, and a deeper path passes AF_UNIX's 108 bytes.
    env["TORCHINDUCTOR_CACHE_DIR"] = scratch
    if framework.startswith("keras-"):
        env["KERAS_BACKEND"] = framework.removeprefix("keras-")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # One compute thread for every framework (as bench_probe): idle pool threads spin for
    # a while after each op, and process CPU time would charge that spinning to whichever
    # variant runs next (measured: the same step 4 ms after one variant, 7.7 after another).
    env["OMP_NUM_THREADS"] = "1"
    flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    chosen = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(chosen) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"bench_frameworks: unknown framework {unknown[0]!r}: {FRAMEWORKS}")
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("frameworks", "child")]
    results: dict[str, Any] = {}
    for framework in chosen:
        with tempfile.TemporaryDirectory(prefix="dbx-bench-") as scratch:
            out = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child", framework],
                env=child_env(framework, scratch),
                capture_output=True,
                text=True,
                check=False,
            )
        if out.returncode != 0:
            raise SystemExit(f"bench_frameworks: {framework} failed:\n{out.stderr[-2000:]}")
        results[framework] = json.loads(out.stdout.splitlines()[-1])
    every = args.every
    emit(
        {
            "benchmark": "probe_frameworks",
            "every": every,
            "model": f"MLP {args.depth} x {args.width}, batch {args.batch}",
            "clock": args.clock,
            "load_1min": os.getloadavg()[0],
            "frameworks": results,
            "met": {
                f"{framework}_probe_cheaper_than_tensorboard_every_{n}": (
                    r["probe_over_tensorboard"][f"every_{n}"] < 1.0
                )
                for framework, r in results.items()
                for n in (every, 1)
            },
        }
    )


if __name__ == "__main__":
    main()
