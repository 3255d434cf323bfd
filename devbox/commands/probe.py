"""`devbox probe NAME`: the statistics devbox.probe sends from a training process in the
box, or one on-demand request (a histogram, a tensor's summary, a saved copy); `--stacks`:
every thread's stack of each probed process, answered by the probe's own thread.

A process whose probe only saves before a release (probe.on_release) has no model: its
link's layers are [], so the statistics skip it and only --stacks asks it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from devbox import protocol
from devbox.boxes import Box
from devbox.connect import backend_for, open_socket
from devbox.errors import DevboxError, UsageError
from devbox.views import probe as probe_view

if TYPE_CHECKING:
    from devbox.ssh.probe import Stacks

NOBODY = (
    "no training process in box {box} uses devbox.probe "
    "(in the training script: `from devbox import probe; probe.watch(model)`)"
)
NO_STACKS = (
    "box {box} has no probed process: stack dumps come from devbox.probe "
    "(probe.watch or probe.on_release) in the training code"
)


def run(args: argparse.Namespace) -> int:
    from devbox.ssh import probe as probe_stream

    layer = args.histogram or args.summary or args.save
    if layer is None and (args.bins is not None or args.tensor != "activation"):
        raise UsageError("--tensor and --bins go with --histogram, --summary or --save")
    if (layer is not None or args.stacks) and (args.watch or args.count is not None):
        raise UsageError("--watch and --count show statistics; a request has one answer")
    if args.bins is not None and not args.histogram:
        raise UsageError("--bins goes with --histogram")
    backend = backend_for(args)
    box = backend.get(args.name)
    if box.state.value not in ("running", "idle"):
        raise UsageError(f"box {box.name} is {box.state.value}: {box.reason or 'not reachable'}")
    if args.stacks:
        sock = open_socket(backend, box)
        found = probe_stream.stacks(box, sock, pid=args.pid, timeout=args.timeout)
        return _stacks(box, found, args)
    if layer is not None:
        kind = "histogram" if args.histogram else "summary" if args.summary else "save"
        request: protocol.ProbeRequest = {
            "id": 1,
            "kind": kind,
            "layer": layer,
            "tensor": args.tensor,
            "bins": args.bins or 30,
        }
        if args.pid is not None:
            request["pid"] = args.pid
        show = _ask(box, request, as_json=args.json)
        what = "answer from the training process (it answers at its next step)"
        probe_stream.stream(
            box,
            open_socket(backend, box),
            requests=[request],
            on_frame=show,
            timeout=args.timeout,
            waiting_for=what,
        )
        return 0
    watch = args.watch or args.count is not None
    show = _follow(box, args, watch=watch)
    try:
        probe_stream.stream(
            box,
            open_socket(backend, box),
            on_frame=show,
            timeout=None if watch else args.timeout,
            waiting_for="statistics from the training process (is it between steps?)",
        )
    except (KeyboardInterrupt, BrokenPipeError):
        return 0  # ctrl-c ends a watch; `devbox probe --watch --json | head`
    return 0


def _stacks(box: Box, found: list[Stacks], args: argparse.Namespace) -> int:
    if not found:
        which = f"no probed process {args.pid}" if args.pid is not None else ""
        raise DevboxError(f"box {box.name}: {which}" if which else NO_STACKS.format(box=box.name))
    for one in found:
        if args.json:
            answer = {"stacks": one.text} if one.text is not None else {"error": one.error}
            print(json.dumps({"pid": one.pid, "cmd": one.cmd, **answer}), flush=True)
            continue
        text = one.text if one.text is not None else f"  {one.error}\n"
        sys.stdout.write(f"process {one.pid} ({one.cmd})\n{text}\n")
    sys.stdout.flush()
    return 0 if all(one.text is not None for one in found) else 1


def _models(processes: object) -> list[dict[str, Any]]:
    """HELLO's processes that watch a model (a release-only link has no layers)."""
    listed = processes if isinstance(processes, list) else []
    return [p for p in listed if isinstance(p, dict) and p.get("layers", True)]


def _ask(
    box: Box, request: protocol.ProbeRequest, *, as_json: bool
) -> Callable[[protocol.Frame], bool]:
    def show(frame: protocol.Frame) -> bool:
        if frame.type == protocol.HELLO:
            if not _models(frame.body.get("processes")):
                raise DevboxError(NOBODY.format(box=box.name))
            return True
        if frame.type != protocol.PROBE_REPLY or frame.body.get("id") != request["id"]:
            return True
        if "error" in frame.body:
            raise UsageError(f"box {box.name}: {frame.body['error']}")
        if as_json:
            print(json.dumps(frame.body), flush=True)
        else:
            reply = protocol.probe_reply(frame)
            sys.stdout.write(probe_view.render_reply(reply, request=dict(request)))
        return False

    return show


def _follow(box: Box, args: argparse.Namespace, *, watch: bool) -> Callable[[protocol.Frame], bool]:
    commands: dict[int, str] = {}
    waiting: set[int] = set()  # snapshot: the processes not shown yet
    shown = 0
    clear = not args.json and watch and sys.stdout.isatty()

    def show(frame: protocol.Frame) -> bool:
        nonlocal shown
        body = frame.body
        if frame.type == protocol.HELLO:
            processes = _models(body.get("processes"))
            if args.pid is not None:
                processes = [p for p in processes if p.get("pid") == args.pid]
            if not processes and not watch:
                which = f"process {args.pid}" if args.pid is not None else ""
                raise DevboxError(
                    NOBODY.format(box=box.name)
                    if not which
                    else f"box {box.name}: no probed {which}"
                )
            commands.update({int(p.get("pid", 0)): probe_view.process_label(p) for p in processes})
            waiting.update(commands)
            return True
        if frame.type == protocol.PROBE_HELLO and _models([body]):
            # A process that connected since (`--watch`): named from its first report on.
            commands[int(body.get("pid", 0))] = probe_view.process_label(body)
            return True
        if frame.type != protocol.PROBE_STATS:
            return True
        pid = body.get("pid")
        if args.pid is not None and pid != args.pid:
            return True
        if not watch and not body.get("watched"):
            # A one-shot shows one fresh report per process (the hub keeps none once the
            # last watcher leaves, so it waits for the next step's); alerts sent between
            # reports show in `devbox ls` and in `--watch`.
            return True
        if args.json:
            print(json.dumps(body), flush=True)
        elif body.get("layers") or body.get("alerts"):
            stats = protocol.probe_stats(frame)
            text = probe_view.render(box.name, stats, cmd=commands.get(int(pid or 0), ""))
            sys.stdout.write(("\x1b[H\x1b[2J" if clear else "") + text)
            sys.stdout.flush()
        if not body.get("watched"):
            return True  # an alert between reports: the statistics are still to come
        shown += 1
        waiting.discard(int(pid or 0))
        if watch:
            return args.count is None or shown < args.count
        return bool(waiting)

    return show
