from __future__ import annotations

from pathlib import Path

import pytest

from devbox import config, names, protocol
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.errors import UsageError


@pytest.mark.parametrize("good", ["a", "box-1", "x" * 63, "0abc"])
def test_valid_names(good: str) -> None:
    assert names.validate_name(good) == good


@pytest.mark.parametrize("bad", ["", "A", "a_b", "-a", "a-", "x" * 64, "a.b", "é"])
def test_invalid_names(bad: str) -> None:
    with pytest.raises(UsageError):
        names.validate_name(bad)


def test_generated_names_are_valid_and_varied() -> None:
    drawn = {names.generate_name() for _ in range(200)}
    assert len(drawn) > 150
    for name in drawn:
        names.validate_name(name)


def test_config_defaults_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.load(tmp_path / "missing.toml") == config.Config()
    path = tmp_path / "c.toml"
    path.write_text('backend = "local"\nmultiplexer = "tmux"\nstart_timeout = 5\n')
    cfg = config.load(path)
    assert (cfg.multiplexer, cfg.start_timeout) == ("tmux", 5.0)
    monkeypatch.setenv("DEVBOX_BACKEND", "kubernetes")
    assert config.select_backend(None, cfg) == "kubernetes"
    assert config.select_backend("local", cfg) == "local"
    monkeypatch.delenv("DEVBOX_BACKEND")
    assert config.select_backend(None, cfg) == "local"


@pytest.mark.parametrize("text", ["start_timeout = true\n", "backend = 3\n", "[local]\nx=1\n"])
def test_config_rejects_wrong_types(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UsageError):
        config.load(path)


def test_protocol_round_trip_and_errors() -> None:
    frame = protocol.decode(protocol.encode(protocol.READY, port=22, gpu_ids=["a"]))
    assert frame.type == "ready" and frame.body == {"port": 22, "gpu_ids": ["a"]}
    assert frame.v == protocol.VERSION
    for bad in (b"not json", b"[1]", b'{"type": "x"}', b'{"v": 1}', b"x" * (2 << 20)):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(bad)
    # A newer peer's unknown frame type decodes; readers skip it by type.
    assert protocol.decode(b'{"v": 1, "type": "future", "x": 1}').type == "future"


def test_box_record_round_trip() -> None:
    box = Box(
        name="b",
        owner="o",
        backend="local",
        spec=BoxSpec(gpus=2),
        state=BoxState.RUNNING,
        port=5,
        gpu_ids=("g0", "g1"),
        place="devbox-b",
        multiplexer="tmux",
        alerts="nan:fc",
        extra={"pid": "1"},
    )
    assert Box.from_json(box.to_json()) == box
    assert box.idle_seconds(10.0) is None


def test_a_record_an_earlier_devbox_wrote_keeps_its_session_kind() -> None:
    """Box records on disk outlive an upgrade: the session's kind was among the extras."""
    old = Box(name="b", owner="o", backend="local", spec=BoxSpec(), state=BoxState.RUNNING)
    data = old.to_json()
    del data["multiplexer"], data["place"], data["alerts"]
    data["extra"] = {"pid": "7", "multiplexer": "none"}
    box = Box.from_json(data)
    assert box.multiplexer == "none" and box.extra == {"pid": "7"}
