"""The probe's parts on their own: the statistics against plain torch, the alert policy,
the wire conversion, the link's reconnection, and use without torch or with bad input."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from devbox import protocol
from devbox.probe import alerts, reporting
from devbox.protocol import LayerStats
from tests.conftest import REPO
from tests.probe import require_torch
from tests.waiting import wait_until


def _layer(**values: Any) -> LayerStats:
    base: dict[str, Any] = {
        "name": "fc",
        "act_mean": 0.0,
        "act_std": 1.0,
        "act_absmax": 2.0,
        "act_zeros": 0.0,
        "act_dead": 0.0,
        "act_nan": 0,
        "act_inf": 0,
        "grad_norm": 1.0,
        "grad_nan": 0,
        "weight_norm": 3.0,
        "update_ratio": 1e-3,
    }
    return cast(LayerStats, {**base, **values})  # `values` may be any field, or a bad one


@pytest.mark.parametrize(
    ("values", "kinds"),
    [
        ({}, []),
        ({"act_nan": 3}, ["nan"]),
        ({"grad_nan": 1, "grad_norm": None}, ["nan"]),
        ({"act_inf": 2}, ["inf"]),
        ({"grad_norm": 5e3}, ["exploding"]),
        ({"grad_norm": 1e-9}, ["vanishing"]),
        ({"grad_norm": 1e-9, "weight_norm": 0.0}, []),  # nothing to learn yet: not vanishing
        ({"act_dead": 0.95}, ["dead"]),
        ({"act_dead": None, "grad_norm": None}, []),
        ({"act_nan": 1, "grad_norm": 1e6, "act_dead": 1.0}, ["nan", "exploding", "dead"]),
    ],
)
def test_alert_policy(values: dict[str, Any], kinds: list[str]) -> None:
    raised = alerts.evaluate([_layer(**values)], step=7, limits=alerts.Thresholds())
    assert [a["kind"] for a in raised] == kinds
    assert all(a["step"] == 7 and a["layer"] == "fc" and "fc" in a["message"] for a in raised)


def test_alert_thresholds_are_settable() -> None:
    limits = alerts.Thresholds(exploding=10.0)
    assert [a["kind"] for a in alerts.evaluate([_layer(grad_norm=11.0)], step=0, limits=limits)]


def test_the_alerts_cell_of_devbox_ls() -> None:
    assert protocol.alerts_cell([]) == ""
    one = alerts.nonfinite_output(step=3)
    assert protocol.alerts_cell([one]) == "nan"
    layer = alerts.evaluate([_layer(act_inf=1)], step=1, limits=alerts.Thresholds())[0]
    assert protocol.alerts_cell([layer, one, one]) == "inf:fc(+2)"


@pytest.mark.parametrize("path", ["activation", "on_device"])
def test_activation_statistics_match_plain_torch(path: str) -> None:
    # `activation` on a CPU tensor takes the float-ops-only CPU path; `on_device` is what
    # runs on a GPU and inside a torch.compile graph (and on the CPU once NaN/Inf appear).
    require_torch()
    import torch

    from devbox.probe import stats

    def activation(x: torch.Tensor) -> list[float]:
        # The CPU path gives numbers, the device path a tensor: the same seven values.
        row = getattr(stats, path)(x)
        return row if isinstance(row, list) else row.tolist()

    torch.manual_seed(1)
    x = torch.relu(torch.randn(16, 10))
    x[:, 3] = 0.0  # a dead unit
    mean, std, absmax, zeros, dead, nan, inf = activation(x)
    assert math.isclose(mean, float(x.mean()), rel_tol=1e-6)
    assert math.isclose(std, float(x.std(unbiased=False)), rel_tol=1e-6)
    assert absmax == float(x.abs().max()) and zeros == pytest.approx(float((x == 0).float().mean()))
    assert dead == pytest.approx(0.1) and nan == inf == 0
    far = 1e4 + torch.randn(64, 8)  # a mean far from zero: no cancellation in the std
    mean, std = activation(far)[:2]
    assert math.isclose(std, float(far.double().std(unbiased=False)), rel_tol=1e-3)
    assert math.isclose(mean, float(far.double().mean()), rel_tol=1e-6)
    # A mean near the spread (mean^2 = 4 var): the one-pass variance is still exact.
    near = 2.0 + torch.randn(256, 64)
    mean, std = activation(near)[:2]
    assert math.isclose(std, float(near.double().std(unbiased=False)), rel_tol=1e-5)
    image = torch.ones(2, 4, 3, 3)
    image[:, 1] = 0.0  # channel 1 is dead in an image-like output
    assert activation(image)[3:5] == pytest.approx([0.25, 0.25])
    bad = torch.tensor([[1.0, math.nan], [math.inf, -math.inf]])
    values = activation(bad)
    assert math.isnan(values[0]) and values[5:] == [1.0, 2.0]
    only_inf = activation(torch.tensor([[0.0, math.inf], [2.0, 0.0]]))
    assert only_inf[2] == math.inf and only_inf[3] == 0.5 and only_inf[5:] == [0.0, 1.0]
    assert math.isnan(activation(torch.ones(3))[4])  # 1-D: no units
    assert activation(torch.zeros(3, dtype=torch.float16))[2:4] == [0.0, 1.0]
    empty = stats.activation(torch.zeros(0, 5))
    empty = empty if isinstance(empty, list) else empty.tolist()
    assert all(math.isnan(v) for v in empty[:5]) and empty[5:] == [0.0, 0.0]


def test_per_layer_norms_and_wire_rows() -> None:
    require_torch()
    import torch

    from devbox.probe import stats

    a, b, c = torch.full((3,), 2.0), torch.full((4,), 1.0), torch.tensor([math.nan])
    owner = torch.tensor([0, 0, 1])
    norms, bad = stats.per_layer_norms([a, b, c], owner, 3)
    assert norms[0].item() == pytest.approx(math.sqrt(12 + 4))
    assert math.isnan(norms[1].item()) and bad.tolist() == [0.0, 1.0, 0.0]
    assert norms[2].item() == 0.0
    row = [math.nan] * len(reporting.COLUMNS)
    row[reporting.COLUMNS.index("act_nan")] = 4.0
    (record,) = reporting.rows(["x"], [row])
    assert record["act_mean"] is None and record["act_nan"] == 4 and record["grad_nan"] == 0


def test_histogram_and_summary() -> None:
    require_torch()
    import torch

    from devbox.probe import stats

    x = torch.tensor([0.0, 1.0, 1.0, 2.0, math.nan])
    counts, bounds, skipped = stats.histogram(x, 2)
    assert counts.tolist() == [1.0, 3.0] and bounds.tolist() == [0.0, 2.0] and skipped == 1
    mean, std, low, high, norm, nan, inf = stats.summary(torch.tensor([3.0, 4.0])).tolist()
    assert (mean, std, low, high, norm, nan, inf) == (3.5, 0.5, 3.0, 4.0, 5.0, 0.0, 0.0)


def test_watch_rejects_bad_input() -> None:
    require_torch()
    import torch

    from devbox import probe

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        probe.watch(object())
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be a whole number"):
            probe.watch(model, every=every)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no layer matches"):
        probe.watch(torch.nn.Sequential(model), layers=["nope*"])


def test_the_link_goes_quiet_and_reconnects(short_tmp: Path) -> None:
    """With no agent the probe costs nothing and trains on; an agent that comes (or comes
    back) gets a new hello and the reports."""
    require_torch()
    import torch

    from devbox import probe

    path = str(short_tmp / "p.sock")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = probe.watch(
        model, every=1, find_socket=lambda: path if os.path.exists(path) else None
    )

    def train(steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()

    train(5)  # no agent: nothing to send, nothing raised
    assert not watcher.link.connected and watcher.step == 5

    for round_ in range(2):  # an agent, then (after it died) a new one at the same path
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen()
        conn, _ = server.accept()
        conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=True))
        reader = conn.makefile("rb")
        assert protocol.decode(reader.readline()).type == protocol.PROBE_HELLO
        _wait(lambda: watcher.watching and watcher.link.connected)
        got: list[protocol.Frame] = []
        feeder = threading.Thread(
            target=lambda got=got, reader=reader: got.append(protocol.decode(reader.readline()))
        )
        feeder.start()
        train(2)
        feeder.join(10)
        assert got and got[0].type == protocol.PROBE_STATS, round_
        assert len(got[0].body["layers"]) == 2
        reader.close()
        conn.close()
        server.close()
        os.unlink(path)
        _wait(lambda: not watcher.link.connected)
        train(3)  # the agent is gone: training goes on
    watcher.close()


_wait = wait_until


def test_update_ratio_of_a_large_layer_from_its_sample(short_tmp: Path) -> None:
    """A tensor larger than stats.SAMPLE has its update measured on a fixed sample of its
    entries: the ratio the probe reports is within a few percent of the exact one."""
    require_torch()
    import torch

    from devbox import probe
    from devbox.probe import stats

    path = str(short_tmp / "p.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))  # 65,792 weights: sampled
    assert model[0].weight.numel() > 8 * stats.SAMPLE
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    watcher = probe.watch(model, every=1, find_socket=lambda: path)
    conn, _ = server.accept()
    conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=True))
    reader = conn.makefile("rb")
    _wait(lambda: watcher.watching and watcher.link.connected)
    exact: dict[int, float] = {}
    for step in range(watcher.step, watcher.step + 6):
        optimizer.zero_grad()
        model(torch.randn(32, 256)).square().mean().backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        after = [p.detach() for p in model.parameters()]
        moved = sum(float((a - b).norm()) ** 2 for a, b in zip(after, before, strict=True))
        exact[step] = math.sqrt(moved) / math.sqrt(sum(float(b.norm()) ** 2 for b in before))
    got: dict[int, float] = {}
    while len(got) < len(exact):
        frame = protocol.decode(reader.readline())
        if frame.type == protocol.PROBE_STATS and frame.body["layers"]:
            got[frame.body["step"]] = frame.body["layers"][0]["update_ratio"]
    watcher.close()
    reader.close()
    conn.close()
    server.close()
    assert got.keys() == exact.keys()
    for step, want in exact.items():
        assert got[step] == pytest.approx(want, rel=0.05), step


def test_a_malformed_request_is_answered_with_what_is_wrong(short_tmp: Path) -> None:
    """A request the probe-request type does not allow (bins as text) gets an error reply
    with its id at once: the asker is not left to time out."""
    require_torch()
    import torch

    from devbox import probe

    path = str(short_tmp / "p.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    watcher = probe.watch(model, every=1, find_socket=lambda: path)
    conn, _ = server.accept()
    reader = conn.makefile("rb")
    assert protocol.decode(reader.readline()).type == protocol.PROBE_HELLO
    request = {"id": 7, "kind": "histogram", "layer": "0", "tensor": "activation", "bins": "9"}
    conn.sendall(protocol.encode(protocol.PROBE_REQUEST, **request))
    reply = protocol.probe_reply(protocol.decode(reader.readline()))
    assert (reply["id"], reply.get("error")) == (
        7,
        "malformed probe-request frame: bins is a string, not an integer",
    )
    watcher.close()
    reader.close()
    conn.close()
    server.close()


def test_without_any_framework_the_probe_names_the_ones_it_hooks() -> None:
    code = (
        "import sys\n"
        "for m in ('torch', 'keras', 'flax'): sys.modules[m] = None\n"
        "import devbox.probe as p\n"
        "try:\n    p.watch(object())\nexcept p.ProbeUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == (
        "devbox.probe needs PyTorch, Keras 3 or Flax NNX in this Python environment "
        "(none is installed)"
    )


def test_a_model_of_no_framework_is_refused_by_name() -> None:
    require_torch()
    import torch

    from devbox import probe

    class Net:
        pass

    with pytest.raises(TypeError, match="a Flax NNX module, not Net"):
        probe.watch(Net())
    with pytest.raises(ValueError, match="every must be a whole number >= 1, not 0"):
        probe.watch(torch.nn.Linear(2, 2), every=0)


def test_importing_the_probe_does_not_import_torch() -> None:
    code = "import sys, devbox, devbox.probe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _server(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    return server


def test_an_unwatched_process_beats_after_a_quiet_while(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody watches and `every` is far: a heartbeat still comes at the first step's end
    STEP_BEAT seconds after the last frame, so the agent sees training go on."""
    require_torch()
    import torch

    from devbox import probe

    monkeypatch.setattr(reporting, "STEP_BEAT", 0.3)
    path = str(short_tmp / "p.sock")
    server = _server(path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = probe.watch(model, every=1000, find_socket=lambda: path)
    conn, _ = server.accept()
    conn.sendall(protocol.encode(protocol.PROBE_CONTROL, watching=False))
    reader = conn.makefile("rb")
    assert protocol.decode(reader.readline()).type == protocol.PROBE_HELLO
    _wait(lambda: watcher.link.connected)
    beats: list[int] = []

    def read() -> None:
        while len(beats) < 3 and (line := reader.readline()):
            frame = protocol.decode(line)
            if frame.type == protocol.PROBE_STATS:
                assert frame.body["watched"] is False and frame.body["layers"] == []
                beats.append(frame.body["step"])

    feeder = threading.Thread(target=read, daemon=True)
    feeder.start()

    def step() -> bool:
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        time.sleep(0.005)
        return len(beats) >= 3

    wait_until(step, 30, "three heartbeats")
    s0, s1, s2 = beats
    assert s0 == 0  # the report step (every) beats as before
    assert 0 < s1 < s2 < 1000  # then time, not the step count, brings them
    assert s2 - s1 >= 2  # one per quiet while, not one per step
    watcher.close()
    feeder.join(5)
    reader.close()
    conn.close()
    server.close()


def test_the_link_thread_answers_stacks_while_training_spins(short_tmp: Path) -> None:
    """A stacks request is answered by the probe's own thread, at once, while the training
    thread is busy in a loop of its own (it holds the GIL but for the switch interval)."""
    require_torch()
    import torch

    from devbox import probe

    path = str(short_tmp / "p.sock")
    server = _server(path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    watcher = probe.watch(model, every=1, find_socket=lambda: path)
    conn, _ = server.accept()
    reader = conn.makefile("rb")
    assert protocol.decode(reader.readline()).type == protocol.PROBE_HELLO
    stop = threading.Event()

    def spin_here() -> None:
        while not stop.is_set():
            pass

    trainer = threading.Thread(target=spin_here, name="trainer")
    trainer.start()
    try:
        request = {"id": 9, "kind": "stacks", "layer": "", "tensor": ""}
        conn.sendall(protocol.encode(protocol.PROBE_REQUEST, **request))
        while (frame := protocol.decode(reader.readline())).type != protocol.PROBE_REPLY:
            pass
    finally:
        stop.set()
        trainer.join()
    reply = protocol.probe_reply(frame)
    assert (reply["id"], reply["pid"], reply["step"]) == (9, os.getpid(), 0)
    text = reply.get("stacks", "")
    assert "thread trainer (ident" in text and "in spin_here" in text, text
    assert "thread devbox-probe (ident" in text and "daemon): the probe, answering" in text
    assert len(text.encode()) <= 64 * 1024
    watcher.close()
    reader.close()
    conn.close()
    server.close()
