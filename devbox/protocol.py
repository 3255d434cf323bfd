"""The agent wire format: versioned, newline-delimited JSON frames.

Shared by the agent, the CLI and the TUI. Every frame is one JSON object on one
line with a protocol version `v` and a `type`. A reader skips types it does not
know (newer agents may send more) and treats a malformed line as an error of
that one stream only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VERSION = 1
# A frame larger than this is malformed; it bounds what one bad peer can make us buffer.
MAX_FRAME_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A frame that cannot be decoded; the stream that carried it is closed."""


@dataclass(frozen=True)
class Frame:
    type: str
    body: dict[str, Any]
    v: int = VERSION


def encode(frame_type: str, **body: Any) -> bytes:
    payload = {"v": VERSION, "type": frame_type, **body}
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Frame:
    if len(line) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(line)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("frame is not a JSON object")
    version, frame_type = data.pop("v", None), data.pop("type", None)
    if not isinstance(version, int) or not isinstance(frame_type, str):
        raise ProtocolError("frame lacks an integer 'v' and a string 'type'")
    if version > VERSION:
        # Readers accept newer minor additions as long as the major shape is ours.
        pass
    return Frame(type=frame_type, body=data, v=version)


# Frame types. The agent sends READY (or ERROR) once on its launch pipe when it
# listens; HELLO opens every stream over SSH.
READY = "ready"
ERROR = "error"
HELLO = "hello"
