"""The Keras probe's unit scenarios, run in one process per backend by
tests/probe/test_keras_unit.py (Keras takes its backend once per process):

    KERAS_BACKEND=jax python -m tests.probe.keras_scenarios OUT.json

Each scenario trains a small model by model.fit with a fake agent on a Unix socket, and
writes what the agent received beside what a direct computation gives; the tests compare.
"""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from devbox import probe, protocol
from devbox.probe import arrays, kerasstats, release
from tests.probe import keras_train
from tests.probe.keras_train import BATCH, batches, make_model, make_reference


class Agent:
    """A fake agent: accepts the probe's link and keeps every frame it sends."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="kp") + "/p.sock"
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(self.path)
        self.server.listen()
        self.frames: list[protocol.Frame] = []
        self.conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.conn, _ = self.server.accept()
        self.conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=True))
        for line in self.conn.makefile("rb"):
            self.frames.append(protocol.decode(line))

    def send(self, frame_type: str, **body: Any) -> None:
        assert self.conn is not None
        self.conn.sendall(protocol.encode(frame_type, **body))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f.body for f in self.frames if f.type == kind]


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _watched(every: int, **kwargs: Any) -> tuple[Any, Any, Agent]:
    model = make_model()
    agent = Agent()
    watcher = probe.watch(model, every=every, find_socket=lambda: agent.path, **kwargs)
    _wait(lambda: watcher.watching and watcher.link.connected, "the link")
    return model, watcher, agent


def _fit(model: Any, x: Any, y: Any, callbacks: list[Any]) -> None:
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


class Kinds(keras.callbacks.Callback):
    """Which train function each step ran: Keras's own, or one of the probe's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.net = model
        self.kinds: list[str] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.kinds.append(getattr(self.net.train_function, "__name__", "?"))


def statistics() -> dict[str, Any]:
    """Every other step observed, with requests answered at the first one."""
    model, watcher, agent = _watched(every=2)
    x, y = batches(6)
    first = [[np.array(w) for w in layer.get_weights()] for layer in model.layers]
    requests = [
        {"id": 1, "kind": "histogram", "layer": "dense", "tensor": "activation", "bins": 7},
        {"id": 2, "kind": "summary", "layer": "dense_1", "tensor": "weight"},
        {"id": 3, "kind": "histogram", "layer": "dense_2", "tensor": "gradient", "bins": 4},
        {"id": 4, "kind": "summary", "layer": "dense_1", "tensor": "activation"},
    ]
    for r in requests:
        agent.send(protocol.PROBE_REQUEST, **r)
    _wait(lambda: len(watcher._requests) == len(requests), "the requests")
    ref = io.StringIO()
    kinds = Kinds(model)
    _fit(model, x, y, [watcher, make_reference(ref, x, y), kinds])
    _wait(lambda: len(agent.of(protocol.PROBE_REPLY)) == len(requests), "the replies")
    _wait(lambda: len([s for s in agent.of(protocol.PROBE_STATS) if s["watched"]]) == 3, "reports")
    normal_after = not getattr(model.train_function, "_devbox_probe", False)
    watcher.close()
    (h1, h2, _), grads = keras_train.forward_backward(x[:BATCH], y[:BATCH], first)
    direct = {
        "1": arrays.histogram(h1, 7),
        "2": arrays.summary(np.concatenate([first[1][0].ravel(), first[1][1]])),
        "3": arrays.histogram(np.concatenate([grads[2][0].ravel(), grads[2][1]]), 4),
        "4": arrays.summary(h2),
    }
    return {
        "hello": agent.of(protocol.PROBE_HELLO)[0],
        "reports": [s for s in agent.of(protocol.PROBE_STATS) if s["watched"]],
        "reference": [json.loads(line) for line in ref.getvalue().splitlines()],
        "replies": agent.of(protocol.PROBE_REPLY),
        "direct": direct,
        "kinds": kinds.kinds,
        "normal_after": normal_after,
    }


class Synced(keras.callbacks.Callback):
    """Waits for each step's loss, as fit's progress bar (verbose=1) does: the device then
    never runs behind the loop. Without it, Keras on JAX may dispatch every step of a short
    fit before the device has made the poisoned one (on a loaded machine it did), and with
    no step left to observe the forced report has nowhere to come."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        float(keras.ops.convert_to_numpy((logs or {})["loss"]))


def nan() -> dict[str, Any]:
    """A NaN in the fourth batch: the check raises the alert, a report says where."""
    model, watcher, agent = _watched(every=10)
    x, y = batches(9, nan_at=3)
    _fit(model, x, y, [Synced(), watcher])  # the loss made before the probe looks
    _wait(lambda: len(agent.of(protocol.PROBE_STATS)) >= 3, "the alert and a report")
    watcher.close()
    return {"stats": agent.of(protocol.PROBE_STATS)}


def selection() -> dict[str, Any]:
    model = make_model()
    out: dict[str, Any] = {}
    one = probe.watch(model, layers=["dense_1"], find_socket=lambda: None)
    out["one"] = one.names
    one.close()
    many = probe.watch(model, layers="dense*", find_socket=lambda: None)
    out["many"] = many.names
    many.close()
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")], name="inner")
    nested = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(2, name="b")])
    for name, layers in (("nested", None), ("nested_inner", ["inner"])):
        w = probe.watch(nested, layers=layers, find_socket=lambda: None)
        out[name] = w.names
        w.close()
    refused: list[tuple[str, Callable[[], Any]]] = [
        ("bad_pattern", lambda: probe.watch(model, layers=["nope*"])),
        ("a_layer", lambda: probe.watch(keras.layers.Dense(2))),
        ("an_object", lambda: probe.watch(object())),
    ]
    for name, call in refused:
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def broken() -> dict[str, Any]:
    """The probe's own failure inside the step: logged once, probe off, training on."""
    model, watcher, _ = _watched(every=1)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("devbox.probe").addHandler(handler)
    real = kerasstats.activation

    def failing(out: Any, axis: int) -> Any:
        raise RuntimeError("the probe's own bug")

    kerasstats.activation = failing
    try:
        x, y = batches(4)
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watcher])
    finally:
        kerasstats.activation = real
    watcher.close()
    return {
        "logged": seen,
        "loss": history.history["loss"][-1],
        "off": watcher._broken,
        "normal_after": not getattr(model.train_function, "_devbox_probe", False),
    }


def release_sync() -> dict[str, Any]:
    """A save at a step boundary mid-epoch reads the weights the step just trained."""
    model, watcher, _ = _watched(every=100)
    seen: list[Any] = []

    class Save:
        def take_and_run(self) -> None:
            seen.append(np.array(model.layers[0].kernel))

    class Ask(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 2:
                release.pending = Save()  # type: ignore[assignment]

    x, y = batches(5)
    _fit(model, x, y, [watcher, Ask()])
    watcher.close()
    kernel = seen[0] if seen else None
    ok = kernel is not None and kernel.dtype == np.float32 and bool(np.isfinite(kernel).all())
    return {"saves": len(seen), "kernel_ok": ok, "shape": list(getattr(kernel, "shape", []))}


def main() -> None:
    out = {}
    for scenario in (statistics, nan, selection, broken, release_sync):
        start = time.monotonic()
        out[scenario.__name__] = scenario()
        out[scenario.__name__]["seconds"] = time.monotonic() - start
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)


if __name__ == "__main__":
    main()
