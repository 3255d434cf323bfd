"""The release handshake's results (protocol.SaveResult): what each process said when the
probe hub asked it to save, or why it said nothing. Pure: the hub does the asking."""

from __future__ import annotations

import asyncio

from devbox import protocol

# Bounds on what one process reports: the results end in a pod annotation.
MAX_ITEMS = 100
MAX_ITEM = 1000
MAX_DETAIL = 300

Answer = asyncio.Future[protocol.ProbeSaved | None]  # None: the process ended first


def result(pid: int, cmd: str, answer: Answer | None, *, limit: float) -> protocol.SaveResult:
    """A process that can save: its answer, or why there is none (`answer` None: it was
    not asked, the deadline had passed; `limit`: the seconds it was given)."""
    if answer is None:
        return _result(pid, cmd, "timeout", detail="the deadline had passed before it was asked")
    if not answer.done():
        return _result(pid, cmd, "timeout", detail=f"no answer within {round(limit, 1):g}s")
    saved = answer.result()
    if saved is None:
        return _result(pid, cmd, "failed", detail="the process ended before it answered")
    items = [str(item)[:MAX_ITEM] for item in saved["saved"][:MAX_ITEMS]]
    error = saved.get("error")
    if error == protocol.NO_SAVE_HANDLER:
        return _result(pid, cmd, "no-handler", saved=items, detail=error)
    if error is not None:
        return _result(pid, cmd, "failed", saved=items, detail=str(error)[:MAX_DETAIL])
    return _result(pid, cmd, "saved", saved=items)


def no_handler(pid: int, cmd: str) -> protocol.SaveResult:
    """A process that watches a model but registered no save."""
    return _result(pid, cmd, "no-handler", detail="probed, no probe.on_release")


def _result(
    pid: int, cmd: str, status: str, *, saved: list[str] | None = None, detail: str = ""
) -> protocol.SaveResult:
    return {"pid": pid, "cmd": cmd, "status": status, "saved": saved or [], "detail": detail}
