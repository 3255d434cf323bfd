"""The typed frame decoders (devbox.protocol): a well-formed body comes back as its TypedDict,
a malformed one of any type is one ProtocolError line that says what is wrong where, and a
client that meets one (`devbox stats`, `devbox probe`, the one SSH session) says it in one
line naming the box, not with a traceback."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devbox import cli, connect, protocol
from devbox.backends.local.store import ALERTS_FILE, BoxStore
from devbox.boxes import Box, BoxSpec, BoxState
from devbox.errors import DevboxError
from devbox.protocol import Frame
from devbox.ssh import client
from devbox.ssh._asyncssh import asyncssh
from tests.tui.synthetic import probe_stats, sample

SAMPLE: dict[str, Any] = dict(sample(0, 2, 7, t=1.0))
STATS: dict[str, Any] = dict(probe_stats(pid=42, step=3, nan_at=3))  # a layer, an alert
REQUEST = {"id": 1, "kind": "histogram", "layer": "fc1", "tensor": "activation", "bins": 30}
REPLY = {"id": 1, "pid": 42, "step": 3, "counts": [1, 2], "low": -1.0, "high": 1}
ALERT = {"kind": "nan", "layer": "fc1", "step": 3, "message": "NaN", "pid": 42, "t": 1.5}
DECODERS: dict[str, Callable[[Frame], object]] = {
    protocol.SAMPLE: protocol.sample,
    protocol.PROBE_STATS: protocol.probe_stats,
    protocol.PROBE_REQUEST: protocol.probe_request,
    protocol.PROBE_REPLY: protocol.probe_reply,
}
GOOD = {
    protocol.SAMPLE: SAMPLE,
    protocol.PROBE_STATS: STATS,
    protocol.PROBE_REQUEST: REQUEST,
    protocol.PROBE_REPLY: REPLY,
}


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def _gpu(**changes: object) -> dict[str, Any]:
    return {**SAMPLE, "gpus": [{**SAMPLE["gpus"][0], **changes}]}


@pytest.mark.parametrize("frame_type", GOOD)
def test_a_well_formed_body_is_its_typed_dict(frame_type: str) -> None:
    frame = Frame(frame_type, GOOD[frame_type])
    assert DECODERS[frame_type](frame) is frame.body
    # Keys a newer peer adds pass: readers skip what they do not know.
    newer = Frame(frame_type, {**frame.body, "from_the_future": {"x": [1]}})
    assert DECODERS[frame_type](newer) is newer.body


def test_history_and_alerts_decode_to_their_lists() -> None:
    assert protocol.history(Frame(protocol.HISTORY, {"samples": [SAMPLE]})) == [SAMPLE]
    assert protocol.alerts([ALERT, _without(_without(ALERT, "pid"), "t")])[0] is ALERT


MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    (protocol.SAMPLE, _without(SAMPLE, "host"), "host is missing"),
    (protocol.SAMPLE, {**SAMPLE, "seq": 1.5}, "seq is a number, not an integer"),
    (protocol.SAMPLE, {**SAMPLE, "gpus": {}}, "gpus is an object, not a list"),
    (protocol.SAMPLE, _gpu(util="busy"), "gpus[0].util is a string, not a number or null"),
    (protocol.SAMPLE, _gpu(lost=0), "gpus[0].lost is an integer, not true or false"),
    (protocol.SAMPLE, _gpu(processes=[{}]), "gpus[0].processes[0].box_pid is missing"),
    (
        protocol.SAMPLE,
        {**SAMPLE, "host": {**SAMPLE["host"], "cpu": [1.0, True]}},
        "host.cpu[1] is a boolean, not a number",
    ),
    (protocol.SAMPLE, {**SAMPLE, "activity": {"clients": 1}}, "activity.last_input is missing"),
    (protocol.PROBE_STATS, _without(STATS, "layers"), "layers is missing"),
    (
        protocol.PROBE_STATS,
        {**STATS, "layers": [{"name": "fc1"}]},
        "layers[0].act_absmax is missing",
    ),
    (
        protocol.PROBE_STATS,
        {**STATS, "alerts": [_without(ALERT, "message")]},
        "alerts[0].message is missing",
    ),
    (protocol.PROBE_STATS, {**STATS, "watched": None}, "watched is null, not true or false"),
    (protocol.PROBE_REQUEST, {**REQUEST, "bins": "30"}, "bins is a string, not an integer"),
    (protocol.PROBE_REQUEST, {**REQUEST, "id": True}, "id is a boolean, not an integer"),
    (protocol.PROBE_REQUEST, _without(REQUEST, "tensor"), "tensor is missing"),
    (protocol.PROBE_REPLY, {**REPLY, "counts": [1, None]}, "counts[1] is null, not an integer"),
    (protocol.PROBE_REPLY, _without(REPLY, "step"), "step is missing"),
]


@pytest.mark.parametrize(("frame_type", "body", "problem"), MALFORMED)
def test_a_malformed_body_is_one_protocol_error_line(
    frame_type: str, body: dict[str, Any], problem: str
) -> None:
    with pytest.raises(protocol.ProtocolError) as caught:
        DECODERS[frame_type](Frame(frame_type, body))
    assert caught.value.message == f"malformed {frame_type} frame: {problem}"
    assert isinstance(caught.value, DevboxError)  # the CLI prints it as one line


def test_a_frame_of_another_type_is_refused() -> None:
    with pytest.raises(protocol.ProtocolError, match=r"^expected a sample frame, got probe-stats$"):
        protocol.sample(Frame(protocol.PROBE_STATS, STATS))


def test_malformed_alerts_are_one_line_and_the_local_store_shows_none(tmp_path: Path) -> None:
    with pytest.raises(protocol.ProtocolError, match=r"^malformed alerts: \[0\].layer is missing$"):
        protocol.alerts([_without(ALERT, "layer")])
    store = BoxStore(tmp_path)
    folder = store.box_dir("b")
    folder.mkdir(parents=True)
    (folder / ALERTS_FILE).write_text('{"alerts": [{"kind": "nan"}]}')
    assert store.alerts("b") == []  # `devbox ls` shows no alert rather than failing
    (folder / ALERTS_FILE).write_text(f'{{"alerts": [{json.dumps(ALERT)}]}}')
    assert store.alerts("b") == [ALERT]


# --- A client that meets a malformed frame: the SSH session, `devbox stats`, `devbox probe`.


class _Reader:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    async def readline(self) -> bytes:
        return self.lines.pop(0) if self.lines else b""

    async def read(self) -> bytes:
        return b""


class _Writer:
    def write(self, data: bytes) -> None:
        pass


class _Process:
    def __init__(self, lines: list[bytes]) -> None:
        self.stdin, self.stdout, self.stderr = _Writer(), _Reader(lines), _Reader([])

    def close(self) -> None:
        pass


class _Connection:
    """What the agent's side of an SSH connection sends down any subsystem channel."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines
        self.closed = False

    async def create_process(self, **options: object) -> _Process:
        return _Process(list(self.lines))

    def close(self) -> None:
        self.closed = True

    async def wait_closed(self) -> None:
        pass


BOX = Box(name="b", owner="o", backend="local", spec=BoxSpec(), state=BoxState.RUNNING)


class _Backend:
    name = "local"

    def get(self, name: str) -> Box:
        return BOX

    def open_socket(self, box: Box) -> socket.socket:
        return socket.socket()


@pytest.fixture
def agent_sends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Connection]]:
    """Makes the box's agent (past the real session and stream clients) send these frames."""
    made: list[_Connection] = []

    def sends(*frames: bytes) -> _Connection:
        conn = _Connection(list(frames))
        made.append(conn)

        async def connect_(box: Box, sock: socket.socket, **_: object) -> _Connection:
            sock.close()
            return conn

        monkeypatch.setattr(client, "connect", connect_)
        monkeypatch.setattr(connect, "get_backend", lambda name, cfg: _Backend())
        return conn

    yield sends
    assert all(c.closed for c in made)  # the session closed its connection, however it ended


def test_the_session_says_a_malformed_frame_and_a_lost_link_in_one_line_naming_the_box(
    agent_sends: Callable[..., _Connection],
) -> None:
    agent_sends()

    async def body(error: BaseException) -> None:
        async with client.session(BOX, socket.socket()):
            raise error

    with pytest.raises(DevboxError) as caught:
        asyncio.run(body(protocol.ProtocolError("malformed sample frame: host is missing")))
    assert caught.value.message == "box b: malformed sample frame: host is missing"
    with pytest.raises(DevboxError) as caught:
        asyncio.run(body(asyncssh.ConnectionLost("reset by peer")))
    assert caught.value.message == "lost the connection to box b: reset by peer"


def test_devbox_stats_says_a_malformed_sample_in_one_line(
    agent_sends: Callable[..., _Connection], capsys: pytest.CaptureFixture[str]
) -> None:
    agent_sends(protocol.encode(protocol.HELLO), protocol.encode(protocol.SAMPLE, **_gpu(util="x")))
    assert cli.main(["stats", "b"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "devbox: error: box b: malformed sample frame: gpus[0].util is a string, not a number "
        "or null\n",
    )


def test_devbox_probe_says_malformed_statistics_in_one_line(
    agent_sends: Callable[..., _Connection], capsys: pytest.CaptureFixture[str]
) -> None:
    agent_sends(
        protocol.encode(protocol.HELLO, processes=[{"pid": 42, "cmd": "python train.py"}]),
        protocol.encode(protocol.PROBE_STATS, **{**STATS, "layers": [{"name": "fc1"}]}),
    )
    assert cli.main(["probe", "b"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "devbox: error: box b: malformed probe-stats frame: layers[0].act_absmax is missing\n",
    )


def test_devbox_probe_says_a_malformed_reply_in_one_line(
    agent_sends: Callable[..., _Connection], capsys: pytest.CaptureFixture[str]
) -> None:
    agent_sends(
        protocol.encode(protocol.HELLO, processes=[{"pid": 42, "cmd": "python train.py"}]),
        protocol.encode(protocol.PROBE_REPLY, **{**REPLY, "low": "-1"}),
    )
    assert cli.main(["probe", "b", "--histogram", "fc1"]) == 1
    _, err = capsys.readouterr()
    assert (
        err == "devbox: error: box b: malformed probe-reply frame: low is a string, not a number\n"
    )
