"""`devbox stats`: a box's live telemetry, once, as a watch, or as JSON lines."""

from __future__ import annotations

import argparse
import json
import sys

from devbox.connect import backend_for, open_socket
from devbox.errors import UsageError
from devbox.views.stats import render


def stats(args: argparse.Namespace) -> int:
    from devbox import protocol
    from devbox.ssh import telemetry

    if args.history and not args.json:
        raise UsageError("--history needs --json (a terminal shows the newest sample only)")
    backend = backend_for(args)
    box = backend.get(args.name)
    if box.state.value not in ("running", "idle"):
        raise UsageError(f"box {box.name} is {box.state.value}: {box.reason or 'not reachable'}")
    watch = args.watch or args.count is not None
    limit = args.count if args.count is not None else (None if watch else 1)
    shown = 0
    clear = not args.json and sys.stdout.isatty()

    def show(frame: protocol.Frame) -> bool:
        nonlocal shown
        if frame.type == protocol.HISTORY:
            for old in frame.body.get("samples", []):
                print(json.dumps(old), flush=False)
            return True
        if args.json:
            print(json.dumps(frame.body), flush=True)
        else:
            # A terminal gets the newest sample in place of the last, as `watch` does.
            text = render(box.name, protocol.sample(frame))
            sys.stdout.write(("\x1b[H\x1b[2J" if clear and watch else "") + text)
            sys.stdout.flush()
        shown += 1
        return limit is None or shown < limit

    try:
        telemetry.stream(
            box,
            open_socket(backend, box),
            rate=args.rate,
            history=args.history,
            on_frame=show,
        )
    except KeyboardInterrupt:
        return 0  # ctrl-c is how a watch ends
    except BrokenPipeError:
        return 0  # `devbox stats --watch --json | head`
    return 0
