"""Saving before the box is released: the training code says how to save, and the agent
asks for it (PROBE_RELEASE) before the box goes, then reports what was saved.

    probe.on_release(lambda reason: save_checkpoint("ckpt.pt"))   # returns what it saved

or, for a loop that would rather poll:

    if probe.release_requested():
        torch.save(model.state_dict(), "ckpt.pt")
        probe.saved("ckpt.pt")

The first call of either (or of `saved`) opens one link for the whole process, beside any
Watcher's, whose hello says `release: true`. When a release comes:
- with a save function, it runs once. Where: if a Watcher of this process ended a step
  lately, at the training thread's next step boundary (after optimizer.step, so the
  weights are consistent and no other thread changes them meanwhile); if no step comes in
  time (an idle REPL, training over, or stuck), on a thread of its own. Its exception is
  reported, never raised into training.
- else, in a polling process, the answer is what `saved(...)` is called with.
- else (only `saved` was ever called) the answer is at once: nothing saved, error
  protocol.NO_SAVE_HANDLER, which the agent reports as "no-handler".
The first answer is the process's answer: a later release request gets it again.

No torch here: a Watcher tells this module of its steps (`steppers`, `pending`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from devbox import protocol
from devbox.probe.link import Link

log = logging.getLogger("devbox.probe")

SaveFn = Callable[[str], object]

GRACE = 2.0  # a step ended this recently: wait this long (or two steps) for the next one
MAX_ITEMS = 100  # what one answer reports: an agent writes it to a pod annotation
MAX_ITEM = 1000
MAX_ERROR = 300

# Every Watcher of this process, each with `last_step` (time.monotonic() at its last
# step's end, 0.0 before the first) and `step_seconds` (the time its last step took).
steppers: weakref.WeakSet[Any] = weakref.WeakSet()
# A save that waits for a step boundary. A Watcher reads this at each step's end, and
# calls at_step() only when it is set: nothing else is paid per step.
pending: _Save | None = None


def on_release(save_fn: SaveFn) -> None:
    """Call `save_fn(reason)` when the box is about to be released; it returns what it
    saved (a path, several, or None). Registering again replaces it."""
    if not callable(save_fn):
        raise TypeError(f"devbox.probe.on_release needs a function, not {type(save_fn).__name__}")
    _releaser().register(save_fn)


def release_requested() -> bool:
    """True once the box's release was asked for. A process that calls this polls: it
    answers with saved(...) once it has saved."""
    return _releaser().poll()


def saved(*what: object) -> None:
    """The polling answer: what was saved (paths, or words). Before a release was asked
    for, or once the process has answered, it does nothing."""
    _releaser().answer_polled([item for w in what for item in _items(w)][:MAX_ITEMS])


def at_step() -> None:
    """At a Watcher's step boundary, on the training thread, while a save waits."""
    global pending
    job = pending
    if job is None:
        return
    pending = None
    job.take_and_run()


class _Save:
    """One run of the save function, claimed by the first of the training thread and the
    save thread (or by a saved() call) to come."""

    def __init__(self, owner: _Releaser, fn: SaveFn, reason: str) -> None:
        self.owner, self.fn, self.reason = owner, fn, reason
        self.taken = threading.Event()

    def take_and_run(self) -> None:
        if not self.owner.claim():
            return
        self.taken.set()
        try:
            what = self.fn(self.reason)
        except BaseException as exc:
            self.owner.finish({"saved": [], "error": _one_line(exc)})
            if not isinstance(exc, Exception):
                raise  # ctrl-c on the training thread is the user's, not the probe's
            return
        try:
            items = _items(what)
        except Exception as exc:  # a generator that fails half way
            self.owner.finish({"saved": [], "error": _one_line(exc)})
            return
        self.owner.finish({"saved": items})

    def run_unless_a_step_does(self, deadline: float) -> None:
        """On its own thread: give the training thread's next step the first chance."""
        global pending
        self.taken.wait(_step_wait(deadline))
        if pending is self:
            pending = None
        self.take_and_run()


class _Releaser:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.save_fn: SaveFn | None = None
        self.polling = False
        self.requested = False
        self.reason, self.deadline = "", 0.0
        self.asked: list[int] = []  # release ids not answered yet
        self.claimed = False  # a save (or saved()) is answering
        self.answer: dict[str, Any] | None = None  # the PROBE_SAVED body, less id and pid
        hello = {"pid": os.getpid(), "cmd": " ".join(sys.argv)[:200], "layers": []}
        self.link = Link(hello={**hello, "every": 0, "release": True}, on_frame=self.on_frame)
        self.link.start()

    def register(self, fn: SaveFn) -> None:
        with self.lock:
            self.save_fn = fn
            # A release asked for already, and nobody answering or about to: save now.
            start = bool(self.asked) and not self.claimed and pending is None
        if start:
            self._start_save(fn)

    def poll(self) -> bool:
        with self.lock:
            self.polling = True
            return self.requested

    def answer_polled(self, items: list[str]) -> None:
        global pending
        if not self.claim(only_once_asked=True):
            return
        pending = None
        self.finish({"saved": items})

    def claim(self, *, only_once_asked: bool = False) -> bool:
        with self.lock:
            if self.claimed or self.answer is not None:
                return False
            if only_once_asked and not self.requested:
                return False
            self.claimed = True
            return True

    def finish(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.answer, ids, self.asked = body, self.asked, []
        for release_id in ids:
            self._send(release_id, body)

    # --- on the link thread -----------------------------------------------------------

    def on_frame(self, frame: protocol.Frame) -> None:
        if frame.type == protocol.PROBE_RELEASE:
            self._released(frame.body)
        elif frame.type == protocol.PROBE_REQUEST:  # stacks were answered by the link
            reply = {"id": frame.body.get("id", 0), "pid": os.getpid(), "step": 0}
            reply["error"] = f"process {os.getpid()} watches no model (only probe.on_release)"
            self.link.submit(lambda: [protocol.encode(protocol.PROBE_REPLY, **reply)])

    def _released(self, body: dict[str, Any]) -> None:
        release_id = body.get("id")
        if isinstance(release_id, bool) or not isinstance(release_id, int):
            log.warning("devbox.probe: a release request without an id: %s", body)
            return
        deadline = body.get("deadline")
        refused: list[int] = []
        with self.lock:
            self.requested = True
            self.reason = str(body.get("reason", ""))
            self.deadline = float(deadline) if isinstance(deadline, int | float) else 0.0
            answer, fn = self.answer, self.save_fn
            if answer is None:
                self.asked.append(release_id)
            # The save running answers it, or saved() will.
            waits = self.claimed or pending is not None or (fn is None and self.polling)
            if answer is None and fn is None and not waits:
                # Nothing can save, now or later: the agent need not wait for its limit.
                refused, self.asked = self.asked, []
        if answer is not None:
            self._send(release_id, answer)
        elif fn is not None and not waits:
            self._start_save(fn)
        for one in refused:
            self._send(one, {"saved": [], "error": protocol.NO_SAVE_HANDLER})

    def _start_save(self, fn: SaveFn) -> None:
        global pending
        job = _Save(self, fn, self.reason)
        pending = job
        thread = threading.Thread(
            target=job.run_unless_a_step_does,
            args=(self.deadline,),
            name="devbox-probe-release",
            daemon=True,  # a save that never returns must not keep the process alive
        )
        thread.start()

    def _send(self, release_id: int, body: dict[str, Any]) -> None:
        frame = protocol.encode(protocol.PROBE_SAVED, id=release_id, pid=os.getpid(), **body)
        self.link.submit(lambda: [frame])


def _step_wait(deadline: float) -> float:
    """How long the save thread leaves to the training thread: 0 when no Watcher stepped
    lately; else a little more than a step, at most half the time the agent gives."""
    now = time.monotonic()
    recent = [s for s in list(steppers) if s.last_step and now - s.last_step < GRACE]
    if not recent:
        return 0.0
    wait = max(GRACE, *(2.0 * float(s.step_seconds) for s in recent))
    left = deadline - time.time() if deadline else wait * 2
    return max(0.0, min(wait, left / 2))


def _items(value: object) -> list[str]:
    """What a save function returned, as the wire's list of strings."""
    if value is None:
        return []
    if isinstance(value, str | os.PathLike):
        found: list[object] = [value]
    elif isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        found = [v for v in value if v is not None]
    else:
        found = [value]
    return [_text(v)[:MAX_ITEM] for v in found[:MAX_ITEMS]]


def _text(value: object) -> str:
    return str(os.fspath(value)) if isinstance(value, os.PathLike) else str(value)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())[:MAX_ERROR]


_lock = threading.Lock()
_state: _Releaser | None = None


def _releaser() -> _Releaser:
    global _state
    with _lock:
        if _state is None:
            _state = _Releaser()
        return _state
