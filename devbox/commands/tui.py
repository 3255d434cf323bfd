"""`devbox tui`: the full-screen dashboard, on the backend the flags name."""

from __future__ import annotations

import argparse

from devbox.connect import backend_for


def run(args: argparse.Namespace) -> int:
    from tui.app import make_app  # Textual costs 0.3 s: only for this command

    # The flags the dashboard passes on to the commands it runs (`devbox ssh` in a box).
    flags = [
        f"--{name}={value}"
        for name, value in (("context", args.context), ("namespace", args.namespace))
        if value
    ]
    app = make_app(backend=backend_for(args), rate=args.rate, cli_flags=flags)
    app.run()
    # Textual has shown the traceback of a crash and set 1: a crash is no success.
    return app.return_code or 0
