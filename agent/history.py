"""The telemetry history a box keeps (`devbox stats --history`, the TUI's charts): compact
samples of the last `seconds`, oldest first.

Kept compressed in blocks: at 1 Hz an 8-GPU sample is a few KiB of JSON, so 10 minutes of
plain entries were megabytes of the agent's memory for a replay that is rarely asked for;
consecutive samples differ in a few digits, and zlib keeps a block at a tenth of that or
less. Only the newest block is plain, so adding stays a list append; a replay decompresses.
"""

from __future__ import annotations

import collections
import zlib
from array import array

BLOCK = 60  # entries per compressed block: a minute at 1 Hz
# zlib's fastest level: one block a minute costs about a millisecond at 8 GPUs, and the
# higher levels gain little on text this repetitive.
LEVEL = 1


class History:
    def __init__(self, seconds: float, *, block: int = BLOCK) -> None:
        self._seconds = seconds
        self._block = block
        # The newest entries, plain, and when each was added (the caller's clock).
        self._open: list[bytes] = []
        self._open_t = array("d")
        # Older ones: (when each was added, its entries joined by newlines, compressed).
        self._sealed: collections.deque[tuple[array[float], bytes]] = collections.deque()

    def add(self, t: float, entry: bytes) -> None:
        """One entry (a line of JSON: no newline in it) taken at `t`."""
        self._open.append(entry)
        self._open_t.append(t)
        if len(self._open) >= self._block:
            self._sealed.append((self._open_t, zlib.compress(b"\n".join(self._open), LEVEL)))
            self._open, self._open_t = [], array("d")
        horizon = t - self._seconds
        while self._sealed and self._sealed[0][0][-1] < horizon:
            self._sealed.popleft()  # all of it is older than the history keeps

    def entries(self, now: float) -> list[bytes]:
        """The entries of the last `seconds` before `now`, oldest first."""
        horizon = now - self._seconds
        out: list[bytes] = []
        for times, packed in self._sealed:
            if times[-1] < horizon:
                continue
            lines = zlib.decompress(packed).split(b"\n")
            out.extend(e for e, t in zip(lines, times, strict=True) if t >= horizon)
        out.extend(e for e, t in zip(self._open, self._open_t, strict=True) if t >= horizon)
        return out

    def stored_bytes(self) -> int:
        """What the entries take, compressed or not (without the containers' overhead)."""
        return sum(len(p) for _, p in self._sealed) + sum(map(len, self._open))
