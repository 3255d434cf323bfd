"""The Flax NNX probe: its statistics against a direct computation (tests/probe/nnx_train.py's
reference), alerts, requests, layer selection and the plain variant, with a fake agent
socket; and once end to end, a real training process in a real local box."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devbox import protocol
from tests.conftest import REPO, User
from tests.probe import require
from tests.waiting import wait_until

TRAIN = REPO / "tests/probe/nnx_train.py"


@pytest.fixture(autouse=True)
def _frameworks() -> None:
    require("jax", "flax")


class Agent:
    """A fake agent: one accepted probe connection, frames read one at a time."""

    def __init__(self, path: str) -> None:
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen()
        self.path = path
        self.conn: socket.socket | None = None
        self.reader: Any = None

    def accept(self, watching: bool = True) -> dict[str, Any]:
        self.conn, _ = self.server.accept()
        self.reader = self.conn.makefile("rb")
        hello = self.read()
        assert hello.type == protocol.PROBE_HELLO
        self.send(protocol.PROBE_CONTROL, watching=watching)
        return hello.body

    def send(self, frame_type: str, **body: Any) -> None:
        assert self.conn is not None
        self.conn.sendall(protocol.encode(frame_type, **body))

    def read(self) -> protocol.Frame:
        return protocol.decode(self.reader.readline())

    def next(self, kind: str, *, layers: bool = False) -> dict[str, Any]:
        while True:
            frame = self.read()
            if frame.type == kind and (not layers or frame.body.get("layers")):
                return frame.body

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.fixture
def agent(short_tmp: Path) -> Iterator[Agent]:
    a = Agent(str(short_tmp / "p.sock"))
    yield a
    a.close()


def _setup(agent: Agent, every: int = 1, layers: Any = None) -> Any:
    """The model, optimizer, watcher and step of nnx_train.py, connected and watched."""
    import optax
    from flax import nnx

    from devbox import probe
    from tests.probe import nnx_train

    model = nnx_train.MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    watcher = probe.watch(model, every=every, layers=layers, find_socket=lambda: agent.path)

    @watcher.jit
    def train_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        loss, grads = watcher.value_and_grad(nnx_train.loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    hello = agent.accept()
    wait_until(lambda: watcher.watching and watcher.link.connected, 10, "watching")
    return model, optimizer, watcher, train_step, hello


def _batch(seed: int, nan: bool = False) -> tuple[Any, Any]:
    import numpy as np

    x = np.random.default_rng(seed).standard_normal((64, 8)).astype(np.float32)
    if nan:
        x[3, 2] = math.nan
    return x, x.sum(1, keepdims=True)


def _close(got: Any, want: Any) -> bool:
    if want is None or (isinstance(want, float) and not math.isfinite(want)):
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6)


def _params(model: Any, name: str) -> list[Any]:
    layer = getattr(model, name)
    return [layer.kernel.get_value(), layer.bias.get_value()]


def test_an_observed_step_matches_a_direct_computation(agent: Agent) -> None:
    from tests.probe import nnx_train

    model, optimizer, watcher, train_step, hello = _setup(agent)
    assert hello["framework"] == "jax" and hello["layers"] == ["l1", "l2", "l3"]
    for seed in range(3):
        x, y = _batch(seed)
        want = nnx_train.reference(model, x, y)
        before = {n: _params(model, n) for n in want}
        step = watcher.step
        train_step(model, optimizer, x, y)
        for n in want:
            moved = [a - b for a, b in zip(_params(model, n), before[n], strict=True)]
            want[n]["update_ratio"] = nnx_train.norm(moved) / want[n]["weight_norm"]
        report = agent.next(protocol.PROBE_STATS, layers=True)
        assert report["step"] == step and [s["name"] for s in report["layers"]] == list(want)
        for stats in report["layers"]:
            for key, value in want[stats["name"]].items():
                assert _close(stats[key], value), (seed, stats["name"], key, stats[key], value)
            assert stats["act_dead"] is not None and stats["grad_nan"] == 0
        assert report["alerts"] == []
    watcher.close()


def test_an_injected_nan_raises_the_alert_within_one_report(agent: Agent) -> None:
    model, optimizer, watcher, train_step, _ = _setup(agent, every=1000)
    train_step(model, optimizer, *_batch(0))  # compiles; step 0 is a report step
    agent.next(protocol.PROBE_STATS, layers=True)
    # The link thread held up until the loop is done, as on a busy machine (or while a
    # JAX loop keeps the GIL): the NaN must still force step 4's report, seen on the
    # training thread. A loop that reads its loss each step (a progress bar's): the device
    # has made step 3's check by step 4's start. 1 and 2 are checked only.
    gate = threading.Event()

    def held() -> list[bytes]:
        gate.wait(60)
        return []

    watcher.submit(held)
    for seed in range(1, 5):
        float(train_step(model, optimizer, *_batch(seed, nan=seed == 3)))
    gate.set()
    alerts: list[dict[str, Any]] = []
    while not alerts:
        alerts = agent.next(protocol.PROBE_STATS)["alerts"]
    assert alerts[0]["kind"] == "nan" and alerts[0]["step"] == 3, alerts
    # The forced report of the next step says where: the weights are NaN from then on.
    report = agent.next(protocol.PROBE_STATS, layers=True)
    assert report["step"] == 4 and report["layers"][0]["act_nan"] > 0
    assert any(a["kind"] == "nan" for a in report["alerts"])
    watcher.close()


def test_a_nan_in_the_last_step_before_close_is_alerted(agent: Agent) -> None:
    model, optimizer, watcher, train_step, _ = _setup(agent, every=1000)
    train_step(model, optimizer, *_batch(0))  # step 0 is a report step
    agent.next(protocol.PROBE_STATS, layers=True)
    train_step(model, optimizer, *_batch(1, nan=True))  # its loss is never read here
    watcher.close()
    alerts: list[dict[str, Any]] = []
    while not alerts:
        alerts = agent.next(protocol.PROBE_STATS)["alerts"]
    assert alerts[0]["kind"] == "nan" and alerts[0]["step"] == 1, alerts


def test_requests_are_answered_with_the_right_numbers(agent: Agent) -> None:
    import numpy as np
    from flax import nnx

    from tests.probe import nnx_train

    model, optimizer, watcher, train_step, _ = _setup(agent, every=1000)
    train_step(model, optimizer, *_batch(0))  # compiles; step 0 is reported
    agent.next(protocol.PROBE_STATS, layers=True)
    asks = [
        {"id": 1, "kind": "histogram", "layer": "l1", "tensor": "activation", "bins": 5},
        {"id": 2, "kind": "summary", "layer": "l2", "tensor": "gradient"},
        {"id": 3, "kind": "summary", "layer": "l3", "tensor": "weight"},
        {"id": 4, "kind": "summary", "layer": "nope", "tensor": "weight"},
    ]
    for a in asks:
        agent.send(protocol.PROBE_REQUEST, **a)
    bad = agent.next(protocol.PROBE_REPLY)
    assert bad["id"] == 4 and "no layer 'nope'" in bad["error"]
    wait_until(lambda: len(watcher._requests) == 3, 10, "the requests")
    x, y = _batch(1)
    out = np.asarray(model.l1(x))
    grads = nnx.grad(nnx_train.loss_fn)(model, x, y)
    gradient = np.concatenate([np.ravel(v) for v in _params(grads, "l2")])
    weight = np.concatenate([np.ravel(v) for v in _params(model, "l3")])
    train_step(model, optimizer, x, y)
    replies: dict[int, dict[str, Any]] = {}
    while len(replies) < 3:
        reply = agent.next(protocol.PROBE_REPLY)
        replies[reply["id"]] = reply
    counts, _ = np.histogram(out, bins=5, range=(out.min(), out.max()))
    assert replies[1]["counts"] == counts.tolist() and sum(counts) == 64 * 32
    assert math.isclose(replies[1]["low"], float(out.min()), rel_tol=1e-5)
    assert math.isclose(replies[2]["norm"], float(np.linalg.norm(gradient)), rel_tol=1e-4)
    assert replies[2]["shape"] == [32 * 16 + 16]
    assert math.isclose(replies[3]["mean"], float(weight.mean()), rel_tol=1e-4, abs_tol=1e-7)
    assert replies[3]["shape"] == [17] and replies[3]["nan"] == 0
    assert watcher.active == []
    watcher.close()


def test_layers_are_chosen_by_pattern(agent: Agent) -> None:
    from flax import nnx

    from devbox import probe
    from tests.probe import nnx_train

    with pytest.raises(ValueError, match=r"no layer matches \['nope\*'\] \(layers: .*l1"):
        probe.watch(nnx_train.MLP(nnx.Rngs(0)), layers=["nope*"], find_socket=lambda: None)
    model, optimizer, watcher, train_step, hello = _setup(agent, layers=["l[13]"])
    assert hello["layers"] == ["l1", "l3"]
    train_step(model, optimizer, *_batch(0))
    report = agent.next(protocol.PROBE_STATS, layers=True)
    assert [s["name"] for s in report["layers"]] == ["l1", "l3"]
    assert all(s["grad_norm"] and s["update_ratio"] for s in report["layers"])
    watcher.close()


def test_a_linen_module_is_refused_by_name() -> None:
    from flax import linen

    from devbox import probe

    with pytest.raises(TypeError, match="Dense is a Flax model but not a Flax NNX module"):
        probe.watch(linen.Dense(3))


def test_unwatched_steps_run_the_plain_variant(agent: Agent) -> None:
    from flax import nnx

    from devbox import probe
    from tests.probe import nnx_train

    model = nnx_train.MLP(nnx.Rngs(0))
    watcher = probe.watch(model, every=1000, find_socket=lambda: agent.path)
    traced: list[str] = []

    @watcher.jit
    def forward(model: Any, x: Any) -> Any:
        traced.append("trace")
        return model(x)

    agent.accept(watching=False)
    wait_until(lambda: watcher.link.connected, 10, "connected")
    x, _ = _batch(0)
    forward(model, x)  # step 0: a report step, checked
    assert forward._check is not None and not forward._observed
    for _ in range(5):
        forward(model, x)
    # Nobody watches: one trace of the check variant and one of the plain one, no more.
    assert len(traced) == 2 and not forward._observed and watcher.step == 6
    watcher.close()
    forward(model, x)
    assert len(traced) == 2  # closed: plain nnx.jit, already compiled


def test_a_box_receives_statistics_matching_the_reference(user: User) -> None:
    """End to end: nnx_train.py in a real local box, `devbox probe --json` there."""
    user.up("nnx")
    ref, log = user.home / "ref.jsonl", user.home / "train.log"
    command = f"{sys.executable} {TRAIN} --ref {ref} --every 4"
    out = user.devbox(
        "ssh", "nnx", "--", f"setsid {command} >{log} 2>&1 </dev/null & echo $!", check=True
    )
    pid = int(out.stdout)
    try:

        def report() -> Any:
            result = user.devbox("probe", "nnx", "--json", timeout=90)
            return result.returncode == 0 and json.loads(result.stdout.splitlines()[0])

        first = wait_until(report, 90, "a report from the NNX trainer", every=0.3)
        assert first["pid"] == pid
        frames = user.devbox(
            "probe", "nnx", "--json", "--watch", "--count", "3", check=True, timeout=90
        )
        reports = [json.loads(line) for line in frames.stdout.splitlines()]
        reports = [r for r in reports if r["watched"]]
        assert reports

        def steps() -> dict[int, Any]:
            rows = [json.loads(line) for line in ref.read_text().splitlines() if line.endswith("}")]
            return {r["step"]: r for r in rows}

        done = wait_until(lambda: all(r["step"] in steps() for r in reports) and steps(), 30, "ref")
        for r in reports:
            assert r["step"] % 4 == 0
            want = done[r["step"]]["layers"]
            assert [s["name"] for s in r["layers"]] == list(want)
            for stats in r["layers"]:
                for key, value in want[stats["name"]].items():
                    assert _close(stats[key], value), (r["step"], stats["name"], key)
            assert r["alerts"] == []
        text = user.devbox("probe", "nnx", check=True).stdout.decode()
        assert f"pid {pid}" in text and "nnx_train.py" in text and "[jax]" in text, text
    finally:
        subprocess.run(["kill", "-9", str(pid)], check=False)
