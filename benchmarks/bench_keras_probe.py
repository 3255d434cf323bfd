"""What devbox.probe costs Keras 3's model.fit, on one backend per process:

    python benchmarks/bench_keras_probe.py --backend jax|torch [--rounds 5] [--steps 200]

An MLP (4 x Dense 256, batch 128), one copy per variant (same seed): no callback; the
probe every=50 with somebody watching (a report every 50 steps, the finiteness check at
the others); the probe every=1 (every step observed); and the probe every=50 unwatched. The
probe reports to an in-process stand-in for the agent that reads every frame. The variants
take turns, one fit of --steps steps each per round (after a warm-up fit that compiles),
so that a shared machine's drift hits them alike. Prints JSON: the median wall time per
step in microseconds of each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from typing import Any


def agent(path: str, watching: bool) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def serve() -> None:
        from devbox import protocol

        conn, _ = server.accept()
        conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=watching))
        while conn.recv(1 << 16):
            pass

    threading.Thread(target=serve, daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="jax")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    import keras
    import numpy as np

    from devbox import probe

    def model() -> Any:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(256, activation="relu") for _ in range(3)]
        m = keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(256)])
        m.compile(optimizer="adam", loss="mse")
        return m

    def watched(every: int, watching: bool) -> tuple[Any, list[Any]]:
        m = model()
        path = tempfile.mkdtemp(prefix="kb") + "/p.sock"
        agent(path, watching)
        w = probe.watch(m, every=every, find_socket=lambda: path)
        deadline = time.monotonic() + 30
        while not (w.link.connected and w.watching == watching) and time.monotonic() < deadline:
            time.sleep(0.01)
        return m, [w]

    variants: dict[str, tuple[Any, list[Any]]] = {
        "no_callback": (model(), []),
        "probe_every_50_watched": watched(50, True),
        "probe_every_1_watched": watched(1, True),
        "probe_every_50_unwatched": watched(50, False),
    }
    rng = np.random.default_rng(0)
    batch = 128
    x = rng.standard_normal((args.steps * batch, 256)).astype("float32")
    y = rng.standard_normal((args.steps * batch, 256)).astype("float32")

    def fit(name: str) -> float:
        m, callbacks = variants[name]
        start = time.perf_counter()
        m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return float((time.perf_counter() - start) / args.steps * 1e6)

    for name in variants:
        fit(name)  # compile, and the probe's observed steps' compile
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(fit(name))
    result = {name: round(statistics.median(t), 1) for name, t in times.items()}
    print(json.dumps({"backend": args.backend, "us_per_step": result, "steps": args.steps}))


if __name__ == "__main__":
    main()
